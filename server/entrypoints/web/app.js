// Macaron chat web UI: vanilla JS client for WebSocket protocol v1 (see server/protocol.py).
(function () {
  "use strict";

  const KEY_STORE = "macaron.key";
  const CONV_STORE = "macaron.conversation";
  const PING_MS = 20000;
  const MAX_BACKOFF_MS = 10000;
  const MAX_DEPTH = 24;

  const $ = (id) => document.getElementById(id);
  const ui = {
    status: $("status"), keyForm: $("key-form"), key: $("api-key"), authNotice: $("auth-notice"),
    newConv: $("new-conversation"), messages: $("messages"), composer: $("composer"),
    input: $("input"), specialist: $("specialist"),
  };

  const store = {
    get(k) { try { return localStorage.getItem(k); } catch (_) { return null; } },
    set(k, v) { try { localStorage.setItem(k, v); } catch (_) { /* storage unavailable */ } },
    del(k) { try { localStorage.removeItem(k); } catch (_) { /* storage unavailable */ } },
  };

  let ws = null;              // current socket (null when none)
  let isReady = false;        // `ready` received on the current socket
  let attempt = 0;            // reconnect attempts since the last `ready`
  let reconnectTimer = null;
  let countdownTimer = null;
  let pingTimer = null;
  let releaseId = "";
  let conversationId = store.get(CONV_STORE);
  const pending = new Map();  // client_msg_id -> user_turn frame not yet answered by turn_completed
  const outbox = [];          // other frames waiting for `ready`
  const sentIds = new Set();  // client_msg_ids sent on the current socket
  let blocker = null;         // first turn sent without a conversation id, awaiting turn_started
  const turns = new Map();    // turn_id -> assistant bubble state
  const turnMsg = new Map();  // turn_id -> client_msg_id

  // --- DOM helpers (text only: never innerHTML) ---------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c);
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  const str = (v) => (v === null || v === undefined ? "" : typeof v === "string" ? v : typeof v === "object" ? JSON.stringify(v) : String(v));
  const arr = (v) => (Array.isArray(v) ? v : []);
  const nearBottom = () => ui.messages.scrollHeight - ui.messages.scrollTop - ui.messages.clientHeight < 80;
  function scrollDown(force) { if (force || nearBottom()) ui.messages.scrollTop = ui.messages.scrollHeight; }
  function append(node) { const stick = nearBottom(); ui.messages.append(node); scrollDown(stick); }

  // --- status line ---------------------------------------------------------------------------

  function setStatus(state) {
    const parts = [state];
    if (releaseId) parts.push(`release ${releaseId}`);
    if (conversationId) parts.push(`conversation ${conversationId}`);
    ui.status.textContent = parts.join(" · ");
    ui.status.dataset.state = state.split(" ")[0];
  }

  function setConversation(id) {
    if (!id || id === conversationId) return;
    conversationId = id;
    store.set(CONV_STORE, id);
  }

  // --- connection ----------------------------------------------------------------------------

  function clearTimers() {
    clearTimeout(reconnectTimer); clearInterval(countdownTimer); clearInterval(pingTimer);
    reconnectTimer = countdownTimer = pingTimer = null;
  }

  function disconnect() {
    clearTimers();
    const old = ws;
    ws = null; isReady = false; sentIds.clear(); blocker = null;
    if (old && old.readyState <= WebSocket.OPEN) old.close(1000, "client reconnect");
  }

  function connect() {
    const key = store.get(KEY_STORE);
    disconnect();
    if (!key) { setStatus("disconnected"); showAuth("Enter an API key to connect."); return; }
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const sock = new WebSocket(`${scheme}//${location.host}/v1/ws`);
    ws = sock;
    setStatus("connecting");
    sock.onopen = () => {
      if (ws !== sock) return;
      const hello = { type: "hello", api_key: key };
      if (conversationId) hello.conversation_id = conversationId;
      sock.send(JSON.stringify(hello));
      pingTimer = setInterval(() => { if (sock.readyState === WebSocket.OPEN) sock.send('{"type":"ping"}'); }, PING_MS);
    };
    sock.onmessage = (ev) => {
      if (ws !== sock) return;
      let frame;
      try { frame = JSON.parse(ev.data); } catch (_) { return; }
      if (frame && typeof frame === "object") handleFrame(frame);
    };
    sock.onclose = (ev) => {
      if (ws !== sock) return;  // a socket we closed on purpose
      clearTimers();
      ws = null; isReady = false; sentIds.clear(); blocker = null;
      if (ev.code === 4401) {
        setStatus("disconnected (bad API key)");
        showAuth(`Authentication failed: ${ev.reason || "invalid API key"}. Please enter the key again.`);
        return;
      }
      scheduleReconnect();
    };
  }

  function scheduleReconnect() {
    const delay = Math.min(500 * 2 ** attempt, MAX_BACKOFF_MS);
    attempt += 1;
    const at = Date.now() + delay;
    const tick = () => {
      const s = Math.max(0, (at - Date.now()) / 1000);
      setStatus(`reconnecting in ${s < 1 ? s.toFixed(1) : Math.ceil(s)}s`);
    };
    tick();
    countdownTimer = setInterval(tick, 250);
    reconnectTimer = setTimeout(connect, delay);
  }

  function showAuth(message) {
    ui.authNotice.textContent = message;
    ui.authNotice.hidden = false;
    ui.keyForm.classList.add("attention");
    ui.key.focus();
  }

  function sendNow(frame) {
    if (!ws || !isReady || ws.readyState !== WebSocket.OPEN) return false;
    ws.send(JSON.stringify(frame));
    return true;
  }

  function send(frame) { if (!sendNow(frame)) outbox.push(frame); }

  // Sends the unanswered user turns not yet sent on this socket, in order, with their original
  // client_msg_id (the server dedupes resends). Until the first turn of a new conversation has
  // started, later turns wait, so that they join its conversation instead of starting another.
  function flushPending() {
    for (const frame of pending.values()) {
      if (sentIds.has(frame.client_msg_id)) continue;
      if (!conversationId && blocker) return;
      if (!sendNow(conversationId ? { ...frame, conversation_id: conversationId } : frame)) return;
      sentIds.add(frame.client_msg_id);
      if (!conversationId) blocker = frame.client_msg_id;
    }
  }

  function onReady(f) {
    isReady = true;
    attempt = 0;
    releaseId = str(f.release_id);
    setSpecialists(arr(f.specialists).map(str));
    if (f.conversation_id) setConversation(f.conversation_id);
    setStatus("connected");
    flushPending();
    while (outbox.length && sendNow(outbox[0])) outbox.shift();
  }

  // The picker offers "auto" and the specialists a turn may go to now (they change with
  // releases: one added, disabled or enabled at run time); a choice still offered is kept.
  function setSpecialists(names) {
    const chosen = ui.specialist.value;
    ui.specialist.replaceChildren(el("option", { value: "", text: "auto" }),
      ...names.map((n) => el("option", { value: n, text: n })));
    ui.specialist.value = names.includes(chosen) ? chosen : "";
  }

  // --- server frames -------------------------------------------------------------------------

  function handleFrame(f) {
    switch (f.type) {
      case "ready": onReady(f); break;
      case "turn_started": onTurnStarted(f); break;
      case "token": textInto(ensureTurn(f.turn_id), str(f.delta)); break;
      case "action": onAction(f); break;
      case "genui": onGenUI(f); break;
      case "turn_completed": onTurnCompleted(f); break;
      case "error": onError(f); break;
      case "pong": break;
      default: break;
    }
  }

  function ensureTurn(turnId) {
    let t = turns.get(turnId);
    if (t) return t;
    const badge = el("span", { class: "badge", "data-testid": "badge", text: "…" });
    const body = el("div", { class: "body" });
    const node = el("div", { class: "msg assistant streaming", "data-testid": "assistant", "data-turn-id": turnId },
      el("div", { class: "meta" }, badge), body);
    t = { id: turnId, node, badge, body, text: "", started: false, done: false, footer: null };
    turns.set(turnId, t);
    append(node);
    return t;
  }

  function resetTurn(t) {  // the server replays a turn (e.g. after a resend): start over
    t.body.replaceChildren();
    t.text = ""; t.done = false;
    if (t.footer) { t.footer.remove(); t.footer = null; }
    t.node.classList.remove("done");
    t.node.classList.add("streaming");
  }

  function textInto(t, delta) {
    if (!delta) return;
    const stick = nearBottom();
    let last = t.body.lastElementChild;
    if (!last || !last.classList.contains("text")) { last = el("span", { class: "text" }); t.body.append(last); }
    last.textContent += delta;
    t.text += delta;
    scrollDown(stick);
  }

  function onTurnStarted(f) {
    const t = ensureTurn(f.turn_id);
    if (t.started) resetTurn(t);
    t.started = true;
    t.badge.textContent = `${str(f.specialist)} · ${str(f.adapter_version)}`;
    t.specialist = str(f.specialist);
    turnMsg.set(f.turn_id, f.client_msg_id);
    setConversation(f.conversation_id);
    if (f.release_id) releaseId = str(f.release_id);
    if (isReady) setStatus("connected");
    const user = ui.messages.querySelector(`[data-testid="user"][data-client-msg-id="${CSS.escape(str(f.client_msg_id))}"]`);
    if (user) user.classList.remove("pending");
    blocker = null;
    flushPending();
  }

  function onAction(f) {
    const t = ensureTurn(f.turn_id);
    const args = Object.entries(f.args || {}).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(", ");
    const line = el("div", { class: f.ok ? "action" : "action failed", "data-testid": "action", "data-ok": String(!!f.ok) });
    line.textContent = `🔧 ${str(f.name)}(${args}) → ${JSON.stringify(f.result === undefined ? null : f.result)}`;
    t.body.append(line);
    scrollDown(false);
  }

  function onGenUI(f) {
    const t = ensureTurn(f.turn_id);
    const stick = nearBottom();
    t.body.append(el("div", { class: "genui", "data-testid": "genui" }, renderComponent(f.tree, { turnId: f.turn_id, inForm: false }, 0)));
    scrollDown(stick);
  }

  function onTurnCompleted(f) {
    const t = ensureTurn(f.turn_id);
    const msgId = turnMsg.get(f.turn_id);
    if (msgId) pending.delete(msgId);
    t.done = true;
    t.node.classList.remove("streaming");
    t.node.classList.add("done");
    if (t.footer) return;  // already completed once (a resent completion)
    const ms = Number(f.latency_ms);
    t.footer = el("div", { class: "footer" },
      el("span", { class: "latency", "data-testid": "latency", text: Number.isFinite(ms) ? `${Math.round(ms)} ms` : "" }),
      feedbackBar(t));
    t.node.append(t.footer);
    scrollDown(false);
  }

  function onError(f) {
    const notice = el("div", { class: "error", "data-testid": "error", role: "alert" });
    notice.textContent = `⚠ ${str(f.code)}: ${str(f.message)}`;
    const t = f.turn_id ? turns.get(f.turn_id) : null;
    if (t) {
      t.body.append(notice);
      t.node.classList.remove("streaming");
      if (!f.retryable) { const m = turnMsg.get(f.turn_id); if (m) pending.delete(m); }
      scrollDown(false);
    } else {
      append(notice);
    }
    if (blocker) { blocker = null; flushPending(); }
    if (f.code === "unauthenticated") showAuth(`Authentication failed: ${str(f.message)}`);
  }

  // --- feedback --------------------------------------------------------------------------------

  function feedbackBar(t) {
    const btn = (testid, label, text) => el("button", { type: "button", class: "fb", "data-testid": testid, "aria-label": label, title: label, text });
    const up = btn("up", "Good answer", "👍");
    const down = btn("down", "Bad answer", "👎");
    const edit = btn("edit", "Edit answer", "✎ Edit");
    const regen = btn("regenerate", "Regenerate answer", "↻");
    up.setAttribute("aria-pressed", "false");
    down.setAttribute("aria-pressed", "false");
    const vote = (kind, chosen, other) => {
      send({ type: "feedback", turn_id: t.id, kind });
      chosen.classList.add("pressed"); chosen.setAttribute("aria-pressed", "true");
      other.classList.remove("pressed"); other.setAttribute("aria-pressed", "false");
    };
    up.addEventListener("click", () => vote("up", up, down));
    down.addEventListener("click", () => vote("down", down, up));
    regen.addEventListener("click", () => send({ type: "feedback", turn_id: t.id, kind: "regenerate" }));
    edit.addEventListener("click", () => openEditor(t));
    return el("div", { class: "feedback", role: "group", "aria-label": "Feedback" }, up, down, edit, regen, rerouteMenu(t));
  }

  // A routing correction: "another specialist should have answered this" (the reroute frame).
  function rerouteMenu(t) {
    const others = [...ui.specialist.options].map((o) => o.value).filter((v) => v && v !== t.specialist);
    const menu = el("select", { class: "reroute", "data-testid": "reroute", "aria-label": "Ask another specialist", title: "Ask another specialist" },
      el("option", { value: "", text: "ask…" }), ...others.map((v) => el("option", { value: v, text: v })));
    menu.addEventListener("change", () => {
      if (menu.value) send({ type: "reroute", turn_id: t.id, specialist: menu.value });
      menu.value = "";
    });
    return menu;
  }

  function openEditor(t) {
    if (t.node.querySelector(".editor")) return;
    const area = el("textarea", { class: "edit-text", "data-testid": "edit-text", "aria-label": "Edited answer", rows: 5, maxlength: 16000 });
    area.value = t.text;
    const save = el("button", { type: "submit", "data-testid": "edit-save", text: "Save" });
    const cancel = el("button", { type: "button", class: "secondary", "data-testid": "edit-cancel", text: "Cancel" });
    const form = el("form", { class: "editor" }, area, el("div", { class: "editor-row" }, save, cancel));
    cancel.addEventListener("click", () => form.remove());
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = area.value;
      if (!text.trim()) { area.focus(); return; }
      send({ type: "feedback", turn_id: t.id, kind: "edit", edited_text: text });
      for (const span of t.body.querySelectorAll(":scope > .text")) span.remove();
      t.body.prepend(el("span", { class: "text", text }));
      t.text = text;
      t.node.classList.add("edited");
      form.remove();
    });
    t.node.append(form);
    area.focus();
  }

  // --- GenUI -----------------------------------------------------------------------------------

  function uiEvent(ctx, componentId, action, value) {
    send({ type: "ui_event", turn_id: ctx.turnId, component_id: str(componentId), action: str(action), value });
  }

  function renderComponent(c, ctx, depth) {
    if (!c || typeof c !== "object" || Array.isArray(c) || typeof c.type !== "string" || depth > MAX_DEPTH) {
      return el("span", { class: "genui-unsupported", text: "(unsupported component)" });
    }
    const render = RENDERERS[c.type];
    if (!render) return el("span", { class: "genui-unsupported", text: "(unsupported component)" });
    const out = render(c, ctx, depth + 1);
    const [node, target] = Array.isArray(out) ? out : [out, out];  // [wrapper, component element]
    target.classList.add(`genui-${c.type.toLowerCase()}`);
    if (c.id !== undefined && c.id !== null) target.setAttribute("data-component-id", str(c.id));
    return node;
  }

  const children = (c, ctx, depth) => arr(c.children).map((ch) => renderComponent(ch, ctx, depth));
  let fieldSeq = 0;
  const fieldId = () => `genui-field-${++fieldSeq}`;

  function optionsOf(c) {
    return arr(c.options).map((o) => (o && typeof o === "object" ? { value: str(o.value ?? o.label), label: str(o.label ?? o.value) } : { value: str(o), label: str(o) }));
  }

  const RENDERERS = {
    Card: (c, ctx, d) => el("section", {}, c.title ? el("h3", { class: "genui-card-title", text: str(c.title) }) : null, ...children(c, ctx, d)),
    Text: (c) => el("p", { text: str(c.text) }),
    Heading: (c) => { const lvl = Math.min(4, Math.max(1, Math.round(Number(c.level)) || 2)); return el(`h${lvl}`, { text: str(c.text) }); },
    Button: (c, ctx) => {
      const b = el("button", { type: "button", text: str(c.label || c.id) });
      b.addEventListener("click", () => uiEvent(ctx, c.id, c.action || "click", null));
      return b;
    },
    List: (c, ctx, d) => el(c.ordered ? "ol" : "ul", {}, ...arr(c.items).map((it) =>
      el("li", {}, it && typeof it === "object" && !Array.isArray(it) && typeof it.type === "string" ? renderComponent(it, ctx, d) : str(it)))),
    Table: (c) => {
      const table = el("table", {},
        el("thead", {}, el("tr", {}, ...arr(c.columns).map((h) => el("th", { scope: "col", text: str(h) })))),
        el("tbody", {}, ...arr(c.rows).map((r) => el("tr", {}, ...arr(r).map((v) => el("td", { text: str(v) }))))));
      return [el("div", { class: "table-wrap" }, table), table];
    },
    Form: (c, ctx, d) => {
      const inner = { ...ctx, inForm: true };
      const form = el("form", {}, ...children(c, inner, d),
        el("button", { type: "submit", class: "genui-submit", text: str(c.submit_label || "Submit") }));
      form.addEventListener("submit", (ev) => {
        ev.preventDefault();
        const value = {};
        for (const f of form.querySelectorAll("input[data-component-id], select[data-component-id]")) value[f.dataset.componentId] = f.value;
        uiEvent(ctx, c.id, "submit", value);
      });
      return form;
    },
    Input: (c) => {
      const id = fieldId();
      const input = el("input", { id, type: "text", placeholder: c.placeholder ? str(c.placeholder) : null });
      if (c.value !== undefined && c.value !== null) input.value = str(c.value);
      return fieldWrap(id, c, input);
    },
    Select: (c, ctx) => {
      const id = fieldId();
      const select = el("select", { id }, ...optionsOf(c).map((o) => el("option", { value: o.value, text: o.label })));
      if (c.value !== undefined && c.value !== null) select.value = str(c.value);
      if (!ctx.inForm) select.addEventListener("change", () => uiEvent(ctx, c.id, "change", select.value));
      return fieldWrap(id, c, select);
    },
    Chart: (c) => renderChart(c),
  };

  // Input/Select: the class and data-component-id go on the control itself (a <label> wraps it).
  function fieldWrap(id, c, control) {
    const wrap = el("label", { class: "genui-field", for: id }, el("span", { class: "genui-label", text: str(c.label || c.id) }), control);
    return [wrap, control];
  }

  // Chart: inline SVG, grouped bars or one polyline per series.
  const COLORS = ["#4f6bed", "#e8774a", "#2fa57a", "#b04fc9", "#d4a72c", "#3aa4c9"];
  function renderChart(c) {
    const labels = arr(c.labels).map(str);
    const series = arr(c.series).filter((s) => s && typeof s === "object").map((s) => ({ name: str(s.name), values: arr(s.values).map(Number) }));
    const W = 420, H = 220, L = 40, R = 10, T = 10, B = 40;
    const all = series.flatMap((s) => s.values.filter(Number.isFinite));
    const max = Math.max(0, ...all), min = Math.min(0, ...all), span = max - min || 1;
    const y = (v) => T + (H - T - B) * (1 - (v - min) / span);
    const n = Math.max(labels.length, ...series.map((s) => s.values.length), 1);
    const slot = (W - L - R) / n;
    const kind = c.kind === "line" ? "line" : "bar";
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${kind} chart: ${series.map((s) => s.name).join(", ")}` });
    root.append(svg("line", { x1: L, y1: y(0), x2: W - R, y2: y(0), class: "axis" }));
    root.append(svg("text", { x: L - 4, y: y(max) + 4, "text-anchor": "end", class: "tick" }, String(+max.toFixed(2))));
    if (min < 0) root.append(svg("text", { x: L - 4, y: y(min) + 4, "text-anchor": "end", class: "tick" }, String(+min.toFixed(2))));
    labels.forEach((lab, i) => root.append(svg("text", { x: L + slot * (i + 0.5), y: H - B + 16, "text-anchor": "middle", class: "tick" }, lab)));
    series.forEach((s, si) => {
      const color = COLORS[si % COLORS.length];
      if (kind === "bar") {
        const bw = (slot * 0.8) / Math.max(series.length, 1);
        s.values.forEach((v, i) => {
          if (!Number.isFinite(v)) return;
          const x = L + slot * i + slot * 0.1 + bw * si;
          const rect = svg("rect", { x, y: Math.min(y(v), y(0)), width: Math.max(bw - 1, 1), height: Math.abs(y(0) - y(v)), fill: color });
          rect.append(svg("title", {}, `${s.name} · ${labels[i] ?? i}: ${v}`));
          root.append(rect);
        });
      } else {
        const pts = s.values.map((v, i) => (Number.isFinite(v) ? `${L + slot * (i + 0.5)},${y(v)}` : null)).filter(Boolean);
        root.append(svg("polyline", { points: pts.join(" "), fill: "none", stroke: color, "stroke-width": 2 }));
      }
      root.append(svg("rect", { x: L + si * 90, y: H - 14, width: 10, height: 10, fill: color }));
      root.append(svg("text", { x: L + si * 90 + 14, y: H - 5, class: "legend" }, s.name));
    });
    return el("figure", {}, root);
  }

  // --- composer ---
  function uuid() {  // crypto.randomUUID needs a secure context; fall back to getRandomValues
    if (typeof crypto.randomUUID === "function") return crypto.randomUUID();
    const b = crypto.getRandomValues(new Uint8Array(16));
    b[6] = (b[6] & 0x0f) | 0x40; b[8] = (b[8] & 0x3f) | 0x80;
    const h = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
    return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
  }

  // --- composer --------------------------------------------------------------------------------

  function sendUserTurn(content) {
    const frame = { type: "user_turn", client_msg_id: uuid(), content };
    if (conversationId) frame.conversation_id = conversationId;
    if (ui.specialist.value) frame.specialist_hint = ui.specialist.value;
    pending.set(frame.client_msg_id, frame);
    const bubble = el("div", { class: "msg user pending", "data-testid": "user", "data-client-msg-id": frame.client_msg_id }, el("div", { class: "body", text: content }));
    append(bubble);
    scrollDown(true);
    flushPending();  // or, when not connected, after the next `ready`
  }

  ui.composer.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const content = ui.input.value;
    if (!content.trim()) return;
    sendUserTurn(content);
    ui.input.value = "";
    ui.input.focus();
  });

  ui.input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      ui.composer.requestSubmit();
    }
  });

  ui.keyForm.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = ui.key.value.trim();
    if (!key) return;
    store.set(KEY_STORE, key);
    ui.authNotice.hidden = true;
    ui.keyForm.classList.remove("attention");
    attempt = 0;
    connect();
  });

  ui.newConv.addEventListener("click", () => {
    store.del(CONV_STORE);
    conversationId = null;
    pending.clear(); outbox.length = 0; turns.clear(); turnMsg.clear();
    ui.messages.replaceChildren();
    attempt = 0;
    connect();
  });

  // --- start -----------------------------------------------------------------------------------

  const storedKey = store.get(KEY_STORE);
  if (storedKey) { ui.key.value = storedKey; connect(); } else { setStatus("disconnected"); ui.key.focus(); }
})();
