// The chat page of `mlxb serve`: conversations kept in this browser's local storage, answers
// streamed from /v1/chat/completions. Every text a user or model writes reaches the page as
// text nodes (the markdown below builds elements and sets textContent, never HTML).
"use strict";

(() => {
  const STORE = "mlxb.chat.conversations";
  const CURRENT = "mlxb.chat.current";
  const SETTINGS = "mlxb.chat.settings";
  const KEY = "mlxb.chat.apiKey";
  const $ = (id) => document.getElementById(id);

  function load(name, fallback) {
    try {
      const value = JSON.parse(localStorage.getItem(name));
      return value === null || value === undefined ? fallback : value;
    } catch (_) {
      return fallback;
    }
  }
  const save = (name, value) => localStorage.setItem(name, JSON.stringify(value));

  // [{id, title, created, messages: [{role, content, stats?, stopped?, error?}]}], newest first.
  let conversations = load(STORE, []);
  let currentId = load(CURRENT, null);
  const settings = Object.assign({ system: "", temperature: 0, max_tokens: 512 }, load(SETTINGS, {}));
  let modelId = null;
  let running = null; // {controller, reply, node}

  const persist = () => {
    save(STORE, conversations);
    save(CURRENT, currentId);
  };
  const current = () => conversations.find((c) => c.id === currentId) || null;

  // ---- markdown, built from elements and text nodes only ----

  function el(tag, text) {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g;

  function inline(text, into) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) into.append(text.slice(last, m.index));
      if (m[1]) into.append(el("code", m[2]));
      else if (m[3]) into.append(el("strong", m[3]));
      else if (m[4]) into.append(el("em", m[4]));
      else {
        const a = el("a", m[5]);
        a.href = m[6];
        a.rel = "noopener noreferrer";
        a.target = "_blank";
        into.append(a);
      }
      last = m.index + m[0].length;
    }
    if (last < text.length) into.append(text.slice(last));
  }

  const FENCE = /^\s*```\s*([\w+#.-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const BULLET = /^\s*[-*+]\s+/;
  const NUMBERED = /^\s*\d+[.)]\s+/;
  const QUOTE = /^>\s?/;
  const startsBlock = (line) =>
    FENCE.test(line) || HEADING.test(line) || BULLET.test(line) || NUMBERED.test(line) || QUOTE.test(line);

  function markdown(text, into) {
    into.replaceChildren();
    const lines = text.split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(FENCE);
      if (fence) {
        const code = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
        i++;
        const pre = el("pre");
        const c = el("code", code.join("\n"));
        if (fence[1]) c.dataset.lang = fence[1];
        pre.append(c);
        into.append(pre);
        continue;
      }
      const heading = line.match(HEADING);
      if (heading) {
        const h = el("h" + Math.min(6, heading[1].length + 2));
        inline(heading[2], h);
        into.append(h);
        i++;
        continue;
      }
      const listKind = BULLET.test(line) ? BULLET : NUMBERED.test(line) ? NUMBERED : null;
      if (listKind) {
        const list = el(listKind === BULLET ? "ul" : "ol");
        for (; i < lines.length && listKind.test(lines[i]); i++) {
          const item = el("li");
          inline(lines[i].replace(listKind, ""), item);
          list.append(item);
        }
        into.append(list);
        continue;
      }
      if (QUOTE.test(line)) {
        const quote = el("blockquote");
        for (; i < lines.length && QUOTE.test(lines[i]); i++) {
          const p = el("p");
          inline(lines[i].replace(QUOTE, ""), p);
          quote.append(p);
        }
        into.append(quote);
        continue;
      }
      if (line.trim() === "") {
        i++;
        continue;
      }
      const p = el("p");
      for (let first = true; i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i]); i++) {
        if (!first) p.append(el("br"));
        inline(lines[i], p);
        first = false;
      }
      into.append(p);
    }
  }

  // ---- the server ----

  function askKey() {
    const dialog = $("key-dialog");
    $("key-input").value = "";
    return new Promise((resolve) => {
      const done = (key) => {
        $("key-ok").onclick = $("key-cancel").onclick = dialog.oncancel = null;
        dialog.close();
        resolve(key);
      };
      $("key-ok").onclick = () => done($("key-input").value.trim() || null);
      $("key-cancel").onclick = () => done(null);
      dialog.oncancel = () => done(null);
      dialog.showModal();
      $("key-input").focus();
    });
  }

  // fetch with the saved bearer key; on 401 asks for a key once and tries again.
  async function call(path, init) {
    for (let attempt = 0; ; attempt++) {
      const key = load(KEY, null);
      const headers = Object.assign({}, init.headers);
      if (key) headers.Authorization = "Bearer " + key;
      const res = await fetch(path, Object.assign({}, init, { headers }));
      if (res.status !== 401 || attempt > 0) return res;
      const given = await askKey();
      if (!given) return res;
      save(KEY, given);
    }
  }

  async function errorOf(res) {
    try {
      const body = await res.json();
      return (body.error && body.error.message) || res.statusText;
    } catch (_) {
      return res.status + " " + res.statusText;
    }
  }

  async function loadModel() {
    try {
      const res = await call("/v1/models", { method: "GET" });
      if (!res.ok) return;
      const list = await res.json();
      modelId = list.data && list.data[0] && list.data[0].id;
      if (modelId) $("model-name").textContent = modelId;
    } catch (_) {
      // The page still works; requests name no model then.
    }
  }

  function statsOf(timings) {
    const stats = {
      tokens: timings.predicted_n,
      tps: timings.predicted_per_second,
      prompt_tokens: timings.prompt_n,
      prompt_ms: timings.prompt_ms,
    };
    if (timings.draft_n !== undefined) {
      stats.drafted = timings.draft_n;
      stats.accepted = timings.draft_n_accepted;
      stats.rounds = timings.draft_rounds;
    }
    return stats;
  }

  function statsText(s) {
    let text = `${s.tokens} tokens · ${s.tps.toFixed(1)} tok/s · prompt ${s.prompt_tokens} tokens in ${Math.round(s.prompt_ms)} ms`;
    if (s.drafted !== undefined) {
      const tau = s.rounds ? 1 + s.accepted / s.rounds : 1;
      text += ` · acceptance length ${tau.toFixed(2)} (${s.accepted} of ${s.drafted} drafted tokens accepted)`;
    }
    return text;
  }

  function history(conv, reply) {
    const messages = [];
    if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
    for (const m of conv.messages) {
      if (m === reply) break;
      if (m.role === "assistant" && (m.error || !m.content)) {
        // A turn that got no answer is left out whole: templates that want the roles to
        // alternate would refuse two user messages in a row.
        if (messages.length && messages[messages.length - 1].role === "user") messages.pop();
        continue;
      }
      messages.push({ role: m.role, content: m.content });
    }
    return messages;
  }

  async function stream(conv, reply) {
    const controller = new AbortController();
    running = { controller, reply, node: null };
    showRunning(true);
    render();
    const body = {
      messages: history(conv, reply),
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number(settings.temperature),
      max_tokens: Number(settings.max_tokens),
    };
    if (modelId) body.model = modelId;
    let tokens = 0;
    let first = null;
    try {
      const res = await call("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!res.ok) throw new Error(await errorOf(res));
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buffered = "";
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        buffered += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffered.indexOf("\n")) >= 0) {
          const line = buffered.slice(0, end).trim();
          buffered = buffered.slice(end + 1);
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
          const choice = chunk.choices && chunk.choices[0];
          const delta = choice && choice.delta && choice.delta.content;
          if (delta) {
            reply.content += delta;
            tokens++;
            if (first === null) first = performance.now();
            const secs = (performance.now() - first) / 1000;
            $("status").textContent =
              `Generating… ${tokens} tokens` + (secs > 0 ? ` · ${(tokens / secs).toFixed(1)} tok/s` : "");
            updateStreaming();
          }
          if (choice && choice.finish_reason) reply.finish = choice.finish_reason;
          if (chunk.timings) reply.stats = statsOf(chunk.timings);
        }
      }
    } catch (e) {
      if (e.name === "AbortError") reply.stopped = true;
      else reply.error = String(e.message || e);
    } finally {
      running = null;
      showRunning(false);
      persist();
      render();
      $("status").textContent = reply.stats
        ? statsText(reply.stats)
        : reply.stopped
          ? "Stopped"
          : reply.error
            ? "Error: " + reply.error
            : "Ready";
    }
  }

  function send() {
    const text = $("prompt").value;
    if (!text.trim() || running) return;
    let conv = current();
    if (!conv) {
      conv = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "", created: Date.now(), messages: [] };
      conversations.unshift(conv);
      currentId = conv.id;
    }
    if (!conv.title) conv.title = text.trim().split("\n")[0].slice(0, 60);
    conv.messages.push({ role: "user", content: text });
    const reply = { role: "assistant", content: "" };
    conv.messages.push(reply);
    $("prompt").value = "";
    persist();
    stream(conv, reply);
  }

  // ---- drawing ----

  function copyText(text, button) {
    const done = () => {
      button.textContent = "copied";
      setTimeout(() => (button.textContent = "copy"), 1200);
    };
    if (navigator.clipboard && navigator.clipboard.writeText) {
      navigator.clipboard.writeText(text).then(done, () => {});
    }
  }

  function messageNode(m) {
    const node = el("article");
    node.className = "message " + m.role;
    const head = el("div");
    head.className = "role";
    head.append(el("span", m.role === "user" ? "You" : "Assistant"));
    const copy = el("button", "copy");
    copy.className = "copy";
    copy.type = "button";
    copy.title = "Copy this message";
    copy.onclick = () => copyText(m.content, copy);
    head.append(copy);
    node.append(head);
    const body = el("div");
    body.className = "body";
    if (m.role === "user") body.textContent = m.content;
    else markdown(m.content, body);
    node.append(body);
    if (m.stopped) node.append(Object.assign(el("div", "stopped"), { className: "note" }));
    if (m.error) node.append(Object.assign(el("div", "Error: " + m.error), { className: "error" }));
    if (m.stats) node.append(Object.assign(el("div", statsText(m.stats)), { className: "stats" }));
    return node;
  }

  function updateStreaming() {
    if (!running || !running.node) return;
    const body = running.node.querySelector(".body");
    markdown(running.reply.content, body);
    const list = $("messages");
    list.scrollTop = list.scrollHeight;
  }

  function render() {
    const items = $("conversations");
    items.replaceChildren();
    for (const c of conversations) {
      const li = el("li");
      if (c.id === currentId) li.className = "current";
      const open = el("button", c.title || "New chat");
      open.className = "title";
      open.type = "button";
      open.onclick = () => {
        if (running) return;
        currentId = c.id;
        persist();
        render();
      };
      const remove = el("button", "×");
      remove.className = "delete";
      remove.type = "button";
      remove.title = "Delete this conversation";
      remove.onclick = () => {
        if (running) return;
        conversations = conversations.filter((x) => x !== c);
        if (currentId === c.id) currentId = null;
        persist();
        render();
      };
      li.append(open, remove);
      items.append(li);
    }
    const list = $("messages");
    list.replaceChildren();
    const conv = current();
    for (const m of conv ? conv.messages : []) {
      const node = messageNode(m);
      if (running && m === running.reply) running.node = node;
      list.append(node);
    }
    list.scrollTop = list.scrollHeight;
  }

  function showRunning(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
    if (on) $("status").textContent = "Generating…";
  }

  function bindSettings() {
    const fields = { "system-prompt": "system", temperature: "temperature", "max-tokens": "max_tokens" };
    for (const [id, name] of Object.entries(fields)) {
      $(id).value = settings[name];
      $(id).oninput = () => {
        settings[name] = $(id).value;
        save(SETTINGS, settings);
      };
    }
  }

  function start() {
    bindSettings();
    $("send").onclick = send;
    $("stop").onclick = () => running && running.controller.abort();
    $("new-chat").onclick = () => {
      if (running) return;
      currentId = null;
      persist();
      render();
      $("prompt").focus();
    };
    $("forget-key").onclick = () => localStorage.removeItem(KEY);
    $("prompt").onkeydown = (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        send();
      }
    };
    render();
    loadModel();
  }

  start();
})();
