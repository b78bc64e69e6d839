"""Takes the README's screenshot of the chat page: a running `mlxb serve` at URL, two questions
asked through the page in headless Chromium, the window saved as a PNG.

    .venv/bin/python scripts/chat_screenshot.py http://127.0.0.1:8080/ docs/images/chat-page.png
"""
import os
import shutil
import sys

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

url, out = sys.argv[1:3]
os.environ["SE_OFFLINE"] = "true"
options = Options()
options.binary_location = os.environ.get("MLXB_CHROMIUM") or shutil.which("chromium")
for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860",
            "--hide-scrollbars", "--force-color-profile=srgb"):
    options.add_argument(arg)
service = Service(os.environ.get("MLXB_CHROMEDRIVER") or shutil.which("chromedriver"))
driver = webdriver.Chrome(service=service, options=options)
wait = WebDriverWait(driver, 300, poll_frequency=0.1)
try:
    driver.get(url)
    wait.until(lambda d: d.find_element(By.ID, "model-name").text not in ("", "mlxb"))
    driver.execute_script("document.getElementById('settings').open = true;")
    tokens = driver.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys("160")
    for question in ("What is the capital of France?",
                     "Write a Python function that reverses a string."):
        box = driver.find_element(By.ID, "prompt")
        driver.execute_script("arguments[0].value = arguments[1];", box, question)
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "stop").get_attribute("hidden") is not None)
    driver.save_screenshot(out)
finally:
    driver.quit()
