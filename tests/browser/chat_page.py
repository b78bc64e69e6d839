"""Drives `mlxb serve`'s chat page in headless Chromium (Debian's chromium + chromedriver, or
MLXB_CHROMIUM / MLXB_CHROMEDRIVER; Selenium from .venv) and checks what a user sees. Called by tests/chat_page.rs:

    chat_page.py URL API_KEY EXPECTED.json [SCREENSHOT.png]

EXPECTED.json: {"prompt", "max_tokens", "answer"} where answer is the API's greedy content for
that single-turn chat. Prints one JSON line of what it saw; any failed check raises."""
import json
import os
import shutil
import sys

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

url, key, expected_path = sys.argv[1:4]
screenshot = sys.argv[4] if len(sys.argv) > 4 else None
expected = json.load(open(expected_path))


def found(env, names):
    path = os.environ.get(env) or next(filter(None, map(shutil.which, names)), None)
    if not path:
        sys.exit(f"no {names[0]} found: install it (scripts/setup.sh --dev does on Debian) or set {env}")
    return path


browser = found("MLXB_CHROMIUM", ["chromium", "chromium-browser", "google-chrome"])
chromedriver = found("MLXB_CHROMEDRIVER", ["chromedriver"])
os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not fetch drivers or browsers.
options = Options()
options.binary_location = browser
for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
            "--window-size=1200,800", "--no-first-run", "--disable-extensions"):
    options.add_argument(arg)
driver = webdriver.Chrome(service=Service(chromedriver), options=options)
wait = WebDriverWait(driver, 60, poll_frequency=0.05)
seen = {}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def by_id(name):
    return driver.find_element(By.ID, name)


def stored():
    return json.loads(driver.execute_script("return localStorage.getItem('mlxb.chat.conversations')") or "[]")


def set_field(name, value):
    field = by_id(name)
    field.clear()
    field.send_keys(str(value))


def send(text):
    box = by_id("prompt")
    driver.execute_script("arguments[0].value = arguments[1];", box, text)
    by_id("send").click()


def last_answer():
    return driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant .body")[-1]


def idle():
    wait.until(lambda d: by_id("stop").get_attribute("hidden") is not None)


try:
    driver.get(url)
    # The server has a key: the page asks for it once (GET /v1/models answers 401 first).
    wait.until(lambda d: by_id("key-dialog").get_attribute("open") is not None)
    by_id("key-input").send_keys(key)
    by_id("key-ok").click()
    wait.until(lambda d: by_id("model-name").text not in ("", "mlxb"))
    seen["model"] = by_id("model-name").text
    check(driver.execute_script("return localStorage.getItem('mlxb.chat.apiKey')") == json.dumps(key),
          "the API key was not kept")

    # 1. A greedy answer, streamed, equal to the API's.
    driver.execute_script("document.getElementById('settings').open = true;")
    set_field("temperature", 0)
    set_field("max-tokens", expected["max_tokens"])
    send(expected["prompt"])
    idle()
    convs = stored()
    check(len(convs) == 1, f"one conversation expected, found {len(convs)}")
    answer = convs[0]["messages"][-1]
    check(answer["role"] == "assistant", "the last message is not the assistant's")
    check(answer["content"] == expected["answer"],
          f"streamed answer {answer['content']!r} differs from the API's {expected['answer']!r}")
    shown = " ".join(last_answer().text.split())
    check(shown == " ".join(expected["answer"].split()),
          f"the page shows {shown!r}, not the answer {expected['answer']!r}")
    stats = driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant .stats")
    check(stats and "tok/s" in stats[-1].text, "no tokens/s under the answer")
    check("tok/s" in by_id("status").text, "no tokens/s in the footer")
    seen["stats"] = stats[-1].text

    # 2. New chat, a long answer, stopped mid-stream.
    by_id("new-chat").click()
    set_field("max-tokens", 20000)
    send("Tell me a very long story.")
    wait.until(lambda d: last_answer().text != "")
    by_id("stop").click()
    idle()
    convs = stored()
    check(len(convs) == 2, f"two conversations expected, found {len(convs)}")
    stopped = convs[0]["messages"][-1]
    check(stopped.get("stopped") is True, "the stopped answer is not marked stopped")
    check(0 < len(stopped["content"]), "the stopped answer kept no text")
    check("stats" not in stopped, "a stopped answer has final statistics")
    seen["stopped_chars"] = len(stopped["content"])

    # 3. Markup is text: a user message with a script and an event handler.
    hostile = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
    set_field("max-tokens", 8)
    send(hostile)
    idle()
    users = driver.find_elements(By.CSS_SELECTOR, "#messages .message.user .body")
    check(users[-1].text == hostile, f"the message shows as {users[-1].text!r}")
    check(driver.execute_script("return window.__pwned === undefined"), "injected script ran")
    check(not driver.find_elements(By.CSS_SELECTOR, "#messages script, #messages img"),
          "a message created elements")

    # 4. An answer's markdown: code blocks and inline formatting render; raw HTML and
    #    javascript: links do not.
    planted = {
        "id": "planted", "title": "markdown", "created": 0,
        "messages": [
            {"role": "user", "content": "show code"},
            {"role": "assistant", "content":
                "Here is **bold** and `x = 1`.\n\n```python\nprint('<b>hi</b>')\n```\n\n"
                "- one\n- two\n\n<script>window.__pwned = 3</script> "
                "[bad](javascript:window.__pwned=4) [ok](https://example.org/)"},
        ],
    }
    driver.execute_script(
        "const c = JSON.parse(localStorage.getItem('mlxb.chat.conversations'));"
        "c.unshift(arguments[0]); localStorage.setItem('mlxb.chat.conversations', JSON.stringify(c));"
        "localStorage.setItem('mlxb.chat.current', JSON.stringify('planted'));", planted)

    # 5. Reload: every conversation is still there.
    driver.refresh()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#conversations li")) == 3)
    body = last_answer()
    code = body.find_elements(By.CSS_SELECTOR, "pre code")
    check(len(code) == 1 and code[0].text == "print('<b>hi</b>')", "the code block is not rendered")
    check(code[0].get_attribute("data-lang") == "python", "the code block lost its language")
    check([e.text for e in body.find_elements(By.CSS_SELECTOR, "strong")] == ["bold"], "no bold: " + body.get_attribute("innerHTML"))
    check([e.text for e in body.find_elements(By.CSS_SELECTOR, "li")] == ["one", "two"], "no list")
    links = body.find_elements(By.CSS_SELECTOR, "a")
    check([a.get_attribute("href") for a in links] == ["https://example.org/"],
          f"links: {[a.get_attribute('href') for a in links]}")
    check(not body.find_elements(By.CSS_SELECTOR, "script, b"), "raw HTML became elements")
    check("<script>" in body.text, "raw HTML is not shown as text")
    check(driver.execute_script("return window.__pwned === undefined"), "injected script ran")
    titles = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#conversations .title")]
    check(expected["prompt"][:60] in titles, f"the first chat is gone after reload: {titles}")
    first = driver.find_elements(By.CSS_SELECTOR, "#conversations .title")[titles.index(expected["prompt"][:60])]
    first.click()
    check(" ".join(last_answer().text.split()) == " ".join(expected["answer"].split()),
          "the reloaded conversation lost its answer")
    seen["conversations"] = len(titles)
    if screenshot:
        driver.save_screenshot(screenshot)
    print(json.dumps(seen))
finally:
    driver.quit()
