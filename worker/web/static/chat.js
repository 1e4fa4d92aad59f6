// The chat page: a plain MQTT client of the worker's contract (docs/protocol.md), over MQTT
// over WebSockets with MQTT.js. It logs in as the user, so the broker's ACL
// (docs/security.md) decides what it may read and write. docs/frontend.md explains each step.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  // A topic part, as the worker checks it (worker/protocol/topics.py).
  const PART = /^[A-Za-z0-9._:-]{1,128}$/;
  const PREFIX = /^[A-Za-z0-9._:-]{1,128}(\/[A-Za-z0-9._:-]{1,128})*$/;
  // What a user can do about each error code (docs/protocol.md, "Errors").
  const HINTS = {
    bad_json: "the worker could not read the request",
    invalid_request: "a field of the request is not accepted",
    too_long: "the message is too long for the model",
    too_large: "the message or the answer is too large",
    busy: "the worker is full: try again in a moment",
    expired: "the request waited too long before it could start",
    rate_limited: "too many requests from this user: wait a minute",
    invalid_schema: "the response format's schema is not accepted",
    unsupported_action: "the worker does not know this control action",
    engine_error: "the engine failed on this request",
    not_authorized: "the broker refused it (topic ACL)",
  };
  const decoder = new TextDecoder();

  // ---- tools: the page's own, run here in the browser when the model calls them
  // (docs/frontend.md, "Tool calls"). The worker keeps a session's tools; the page sends its
  // list with every message all the same (the same text each time, so the prompt's cached
  // prefix stays), since after a reset or in a new session the worker has none.
  const LOCAL_TIME_TOOL = {
    type: "function",
    function: {
      name: "get_local_time",
      description: "Get the user's current local time, date and time zone.",
      parameters: { type: "object", properties: {}, additionalProperties: false },
    },
  };
  // A sentence rather than JSON: a small model passes it on to the user as it is.
  function localTime() {
    const now = new Date();
    const zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "unknown";
    const minutes = -now.getTimezoneOffset();
    const hhmm = (m) => `${String(Math.floor(m / 60)).padStart(2, "0")}:${String(m % 60).padStart(2, "0")}`;
    const time = hhmm(now.getHours() * 60 + now.getMinutes());
    const date = now.toLocaleDateString("en-GB", { weekday: "long", day: "numeric", month: "long", year: "numeric" });
    return `The local time is ${time} on ${date} (time zone ${zone}, UTC${minutes < 0 ? "-" : "+"}${hhmm(Math.abs(minutes))}).`;
  }
  const PAGE_TOOLS = { get_local_time: localTime };
  // Tool rounds per message: the results of the last one ask for a text answer (toolChoice
  // none), so a model that keeps calling cannot keep the page busy.
  const MAX_TOOL_ROUNDS = 4;

  // The result of one call: what the tool returned, or what went wrong (the model is told).
  function runTool(call) {
    const tool = PAGE_TOOLS[call.function.name];
    if (!tool) return `error: this page has no tool named ${call.function.name}`;
    try {
      return String(tool(JSON.parse(call.function.arguments || "{}")));
    } catch (err) {
      return `error: ${err.message}`;
    }
  }

  const page = {
    client: null,
    ready: false, // connected and subscribed: only then may it publish (replies are never missed)
    prefix: "chat",
    user: "",
    session: "",
    turns: [],
    workers: new Map(), // workerId -> "online" | "offline"
  };

  // ---- storage: settings and the transcript survive a reload; the password only this tab's
  const local = window.localStorage;
  const tab = window.sessionStorage;
  const transcriptKey = () => `mqtt-vllm-worker:turns:${page.prefix}/${page.user}/${page.session}`;
  // A request with images is megabytes: kept in this tab's memory only (localStorage holds about
  // 5 MB); after a reload such a pending message is not sent again (publishRequest says so).
  const KEPT_PAYLOAD = 256 * 1024;
  function saveTurns() {
    const kept = page.turns.map(({ stream, payload, ...turn }) =>
      payload && payload.length <= KEPT_PAYLOAD ? { ...turn, payload } : turn,
    );
    local.setItem(transcriptKey(), JSON.stringify(kept));
  }
  function loadTurns() {
    try {
      return JSON.parse(local.getItem(transcriptKey()) || "[]");
    } catch {
      return [];
    }
  }

  function randomId(prefix) {
    const bytes = new Uint8Array(8);
    crypto.getRandomValues(bytes);
    return prefix + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  const topic = (kind) => `${page.prefix}/${page.user}/${page.session}/${kind}`;

  // ---- the form's fields: URL parameters first, then what this browser remembers
  function initFields() {
    const params = new URLSearchParams(location.search);
    $("broker-url").value = params.get("broker") || local.getItem("mqtt-vllm-worker:broker") || `ws://${location.hostname || "127.0.0.1"}:9001`;
    $("username").value = params.get("user") || local.getItem("mqtt-vllm-worker:user") || "";
    $("prefix").value = params.get("prefix") || local.getItem("mqtt-vllm-worker:prefix") || "chat";
    $("session-id").value = params.get("session") || local.getItem("mqtt-vllm-worker:session") || randomId("web-");
    $("password").value = tab.getItem("mqtt-vllm-worker:password") || "";
    // The sampling may come in the address too (?temperature=0&maxTokens=64: what a demo's
    // model needs, scripts/tools-demo.sh --web), over what this browser remembers.
    const inUrl = { "max-tokens": "maxTokens", temperature: "temperature" };
    for (const id of ["max-tokens", "temperature", "system-prompt", "tool-choice", "forced-tool-name"]) {
      const kept = local.getItem(`mqtt-vllm-worker:${id}`);
      const given = inUrl[id] ? params.get(inUrl[id]) : null;
      if (given !== null) $(id).value = given;
      else if (kept !== null) $(id).value = kept;
      $(id).addEventListener("change", () => local.setItem(`mqtt-vllm-worker:${id}`, $(id).value));
    }
    for (const id of ["offer-time-tool", "use-worker-tools"]) {
      const box = $(id);
      box.checked = local.getItem(`mqtt-vllm-worker:${id}`) === "1";
      box.addEventListener("change", () => {
        local.setItem(`mqtt-vllm-worker:${id}`, box.checked ? "1" : "0");
        updateToolChoice();
      });
    }
    $("tool-choice").addEventListener("change", updateToolChoice);
    updateToolChoice();
  }
  // A choice only where some tool is offered; forcing the page's own tool only where it is.
  function updateToolChoice() {
    const own = $("offer-time-tool").checked;
    const worker = $("use-worker-tools").checked;
    $("tool-choice").disabled = !own && !worker;
    $("tool-choice").querySelector('option[value="get_local_time"]').disabled = !own;
    $("forced-tool").hidden = $("tool-choice").value !== "named";
  }

  // The address in the location bar resumes this conversation (bookmark it, reload it).
  function rememberSession() {
    local.setItem("mqtt-vllm-worker:broker", $("broker-url").value);
    local.setItem("mqtt-vllm-worker:user", page.user);
    local.setItem("mqtt-vllm-worker:prefix", page.prefix);
    local.setItem("mqtt-vllm-worker:session", page.session);
    const params = new URLSearchParams(location.search);
    params.set("broker", $("broker-url").value);
    params.set("user", page.user);
    params.set("session", page.session);
    if (page.prefix !== "chat") params.set("prefix", page.prefix);
    else params.delete("prefix");
    history.replaceState(null, "", `${location.pathname}?${params}`);
  }

  // ---- status line
  function setBroker(text, cls) {
    const el = $("broker-status");
    el.textContent = `broker: ${text}`;
    el.className = `pill ${cls}`;
  }
  function renderWorkers() {
    const el = $("worker-status");
    const online = [...page.workers].filter(([, s]) => s === "online").map(([id]) => id);
    if (online.length) {
      el.textContent = `worker: ${online.join(", ")} online`;
      el.className = "pill on";
    } else if (page.workers.size) {
      el.textContent = "worker: offline (requests wait in the broker)";
      el.className = "pill off";
    } else {
      el.textContent = "worker: unknown";
      el.className = "pill unknown";
      el.title = "no retained status received: no worker has run on this broker, or the ACL does not let this user read it";
    }
  }
  function loginProblem(text) {
    const el = $("login-problem");
    el.textContent = text || "";
    el.hidden = !text;
    if (text) $("login").open = true;
  }

  function setReady(ready) {
    page.ready = ready;
    $("message").disabled = !ready;
    $("send").disabled = !ready;
    $("attach").disabled = !ready;
    $("reset").disabled = !ready;
    $("connect").disabled = !!page.client;
    $("disconnect").disabled = !page.client;
    updateCancel();
    // Approve / Decline buttons work only while connected.
    page.turns.filter((t) => t.status === "done" && !t.answered && (t.toolCalls || []).some((c) => c.needsConfirmation)).forEach(render);
  }
  function updateCancel() {
    $("cancel").disabled = !page.ready || !page.turns.some((t) => t.status === "pending");
  }

  // ---- transcript
  function fmtMs(ms) {
    if (typeof ms !== "number") return "?";
    return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${ms.toFixed(ms < 10 ? 1 : 0)} ms`;
  }
  // A reply's deltas put together in seq order (QoS 0: one may be missing, or come late).
  function newStream() {
    return { next: 0, early: new Map(), text: "", reasoning: "", events: [] };
  }
  function addDelta(stream, delta) {
    if (delta.seq < stream.next) return;
    stream.early.set(delta.seq, delta);
    // A gap waits for its delta until 8 later ones have come; then it is skipped.
    while (stream.early.size && (stream.early.has(stream.next) || stream.early.size > 8)) {
      const d = stream.early.get(stream.next);
      stream.early.delete(stream.next);
      stream.next += 1;
      if (d) {
        stream.text += d.delta || "";
        stream.reasoning += d.reasoning || "";
        if (d.toolEvent) addToolEvent(stream, d.toolEvent);
      }
    }
  }

  // The worker's own calls while it answers (docs/tools.md): one line a call, "running" from
  // its start event until its end event.
  function addToolEvent(stream, event) {
    const known = stream.events.find((e) => e.toolCallId === event.toolCallId);
    if (known) Object.assign(known, event);
    else stream.events.push({ ...event });
  }
  function eventLine(event) {
    const line = document.createElement("div");
    line.className = "tool-event";
    line.dataset.toolCallId = event.toolCallId;
    line.dataset.event = event.event;
    if (event.event === "start") {
      line.textContent = `\u25b6 ${event.name} running\u2026`;
    } else {
      line.dataset.outcome = event.outcome;
      line.textContent = `${event.outcome === "ok" ? "\u2713" : "\u2717"} ${event.name} ${fmtMs(event.durationMs)} (${event.outcome})`;
    }
    return line;
  }
  // A call the worker ran, listed under its reply: what it was called with, what came back.
  function workerCallLine(call) {
    const line = document.createElement("div");
    line.className = "worker-call";
    line.dataset.toolCallId = call.id;
    line.dataset.outcome = call.outcome;
    const label = document.createElement("span");
    label.className = "tool-label";
    label.textContent = `worker call ${call.outcome === "ok" ? "\u2713" : "\u2717"}`;
    const code = document.createElement("code");
    code.textContent = `${call.name} ${call.arguments}`;
    const result = document.createElement("span");
    result.className = "tool-output";
    result.textContent = ` \u2192 ${call.result}`;
    const meta = document.createElement("span");
    meta.className = "worker-call-meta";
    meta.textContent = ` (${call.outcome}, ${fmtMs(call.durationMs)}, round ${call.round + 1})`;
    line.append(label, " ", code, result, meta);
    return line;
  }

  function turnElement(turn) {
    let el = document.querySelector(`article[data-request-id="${CSS.escape(turn.requestId)}"]`);
    if (el) return el;
    el = document.createElement("article");
    el.className = "turn";
    el.dataset.requestId = turn.requestId;
    el.dataset.kind = turn.results ? "results" : "message";
    const user = document.createElement("div");
    if (turn.results) {
      // A request with the results of the page's tool calls: they stand where a message would.
      user.className = "bubble user tool-results";
      for (const result of turn.results) {
        const line = document.createElement("div");
        line.className = "tool-result";
        line.dataset.toolCallId = result.toolCallId;
        const label = document.createElement("span");
        label.className = "tool-label";
        label.textContent = "tool result";
        const name = document.createElement("code");
        name.textContent = result.name;
        const output = document.createElement("span");
        output.className = "tool-output";
        if (result.approved === undefined) {
          output.textContent = result.content;
          line.append(label, " ", name, ": ", output);
        } else {
          label.textContent = result.approved ? "approved" : "declined";
          line.dataset.approved = String(result.approved);
          line.append(label, " ", name);
        }
        user.append(line);
      }
    } else {
      user.className = "bubble user";
      if (turn.thumbs && turn.thumbs.length) {
        const thumbs = document.createElement("div");
        thumbs.className = "thumbs";
        for (const src of turn.thumbs) thumbs.append(thumbnail(src));
        const text = document.createElement("div");
        text.textContent = turn.message;
        user.append(thumbs, text);
      } else {
        user.textContent = turn.message;
      }
    }
    const assistant = document.createElement("div");
    assistant.className = "bubble assistant";
    const reasoning = document.createElement("details");
    reasoning.className = "reasoning";
    reasoning.hidden = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const reasoningText = document.createElement("div");
    reasoningText.className = "reasoning-text";
    reasoning.append(summary, reasoningText);
    const work = document.createElement("div");
    work.className = "worker-tools";
    const reply = document.createElement("div");
    reply.className = "reply-text";
    const calls = document.createElement("div");
    calls.className = "tool-calls";
    const meta = document.createElement("div");
    meta.className = "meta";
    assistant.append(reasoning, work, reply, calls, meta);
    el.append(user, assistant);
    $("transcript").append(el);
    return el;
  }
  // Deltas are drawn at most once a frame, however fast they come (the worker sends one per
  // engine step: up to the model's tokens per second), and the transcript follows a growing
  // reply (unless the user scrolled up) in the same frame, so that a long reply is laid out
  // once a frame rather than once a delta.
  let atEnd = true;
  let frameQueued = false;
  const growing = new Set();
  function follow() {
    if (frameQueued) return;
    frameQueued = true;
    requestAnimationFrame(() => {
      frameQueued = false;
      for (const turn of growing) if (turn.status === "pending") renderTurn(turn);
      growing.clear();
      const box = $("transcript");
      if (atEnd) box.scrollTop = box.scrollHeight;
    });
  }
  function renderSoon(turn) {
    growing.add(turn);
    follow();
  }
  function render(turn) {
    growing.delete(turn);
    renderTurn(turn);
    follow();
  }
  function renderTurn(turn) {
    const el = turnElement(turn);
    el.dataset.status = turn.status;
    el.dataset.finishReason = turn.finishReason || "";
    el.dataset.errorCode = turn.error ? turn.error.code : "";
    let reply = turn.reply;
    let reasoning = turn.reasoning;
    if (turn.status === "pending" && turn.stream) {
      // The deltas so far; the final reply's text replaces them.
      reply = turn.stream.text;
      reasoning = turn.stream.reasoning;
    }
    el.querySelector(".reply-text").textContent = reply || "";
    // The worker's calls: as they run while the reply streams, then the reply's list.
    const work = el.querySelector(".worker-tools");
    if (turn.status === "pending") {
      work.replaceChildren(...(turn.stream ? turn.stream.events.map(eventLine) : []));
    } else {
      work.replaceChildren(...(turn.workerCalls || []).map(workerCallLine));
    }
    const calls = el.querySelector(".tool-calls");
    calls.replaceChildren();
    for (const call of turn.toolCalls || []) {
      const line = document.createElement("div");
      line.className = "tool-call";
      line.dataset.toolCallId = call.id;
      const label = document.createElement("span");
      label.className = "tool-label";
      label.textContent = call.needsConfirmation ? "the worker asks to run" : "tool call";
      const code = document.createElement("code");
      code.textContent = `${call.function.name} ${call.function.arguments}`;
      line.append(label, " ", code);
      if (call.needsConfirmation) line.append(" ", confirmation(turn, call));
      calls.append(line);
    }
    const fold = el.querySelector(".reasoning");
    fold.hidden = !reasoning;
    el.querySelector(".reasoning-text").textContent = reasoning || "";
    const tokens = turn.usage && turn.usage.reasoningTokens;
    fold.querySelector("summary").textContent = tokens ? `Reasoning (${tokens} tokens)` : "Reasoning";
    const meta = el.querySelector(".meta");
    meta.replaceChildren();
    if (turn.error) {
      const code = document.createElement("code");
      code.className = "error-code";
      code.textContent = turn.error.code;
      const hint = HINTS[turn.error.code];
      meta.append(code, ` ${turn.error.message || ""}${hint ? ` (${hint})` : ""}`);
      meta.className = "meta error";
      return;
    }
    meta.className = "meta";
    if (turn.status === "pending") {
      meta.textContent = turn.cancelling ? "cancelling…" : turn.resumed ? "waiting for the reply (resumed)…" : "generating…";
      return;
    }
    const u = turn.usage || {};
    const l = turn.latency || {};
    const reasoningPart = u.reasoningTokens ? `, ${u.reasoningTokens} reasoning` : "";
    meta.textContent =
      `${turn.finishReason} · ${u.promptTokens} prompt tokens (${u.cachedTokens} cached` +
      (u.imageTokens ? `, ${u.imageTokens} of images` : "") +
      `) · ` +
      `${u.completionTokens} completion${reasoningPart} · first token ${fmtMs(l.ttftMs)}, ` +
      `total ${fmtMs(l.totalMs)} in the worker (queue ${fmtMs(l.queueMs)})` +
      (turn.roundTripMs ? ` · ${fmtMs(turn.roundTripMs)} here` : "");
  }
  // Approve / Decline of a worker call that needs the user's confirmation; once decided, what
  // was decided. The decisions of a reply go back together, with the page's own results.
  function confirmation(turn, call) {
    const box = document.createElement("span");
    box.className = "confirm";
    const decided = (turn.decisions || {})[call.id];
    if (decided !== undefined) {
      box.textContent = decided ? "approved" : "declined";
      box.dataset.decided = String(decided);
      return box;
    }
    for (const [text, approved] of [["Approve", true], ["Decline", false]]) {
      const button = document.createElement("button");
      button.type = "button";
      button.className = approved ? "approve" : "decline";
      button.textContent = text;
      button.disabled = !page.ready || turn.answered;
      button.addEventListener("click", () => decide(turn, call.id, approved));
      box.append(button);
    }
    return box;
  }
  function decide(turn, callId, approved) {
    if (!page.ready || turn.answered) return;
    turn.decisions = { ...(turn.decisions || {}), [callId]: approved };
    saveTurns();
    render(turn);
    if (turn.toolCalls.every((c) => !c.needsConfirmation || c.id in turn.decisions)) sendResults(turn);
  }

  function note(text, cls = "note") {
    const el = document.createElement("p");
    el.className = cls;
    el.textContent = text;
    $("transcript").append(el);
    follow();
  }
  function redraw() {
    $("transcript").replaceChildren();
    page.turns.forEach(renderTurn);
    atEnd = true;
    follow();
  }

  // ---- MQTT
  function connect() {
    const user = $("username").value.trim();
    const session = $("session-id").value.trim();
    const prefix = $("prefix").value.trim().replace(/\/+$/, "");
    if (!PART.test(user) || user.startsWith("_")) return loginProblem("User: 1 to 128 of A-Z a-z 0-9 . _ : - (not starting with _)");
    if (!PART.test(session)) return loginProblem("Session: 1 to 128 of A-Z a-z 0-9 . _ : -");
    if (!PREFIX.test(prefix)) return loginProblem("Topic prefix: topic levels of A-Z a-z 0-9 . _ : -");
    loginProblem("");
    Object.assign(page, { user, session, prefix });
    page.turns = loadTurns();
    redraw();
    rememberSession();
    const password = $("password").value;
    tab.setItem("mqtt-vllm-worker:password", password);
    tab.setItem("mqtt-vllm-worker:autoconnect", "1");
    setBroker("connecting", "unknown");
    const client = mqtt.connect($("broker-url").value, {
      protocolVersion: 5,
      clientId: randomId("web-"),
      username: user,
      password: password || undefined,
      clean: true, // nothing is lost by it: pending requests are sent again with their requestId
      reconnectPeriod: 3000,
      connectTimeout: 10000,
    });
    page.client = client;
    setReady(false);
    client.on("connect", () => {
      setBroker("connected", "on");
      loginProblem(""); // a connection problem before this one is over
      $("login").open = false;
      subscribe(client);
    });
    client.on("reconnect", () => setBroker("reconnecting", "unknown"));
    client.on("offline", () => {
      setBroker("disconnected", "off");
      setReady(false);
    });
    client.on("error", (err) => {
      // CONNACK 134/135 (MQTT 5), 4/5 (3.1.1): wrong credentials. Retrying would not help.
      if ([4, 5, 134, 135].includes(err.code)) {
        loginProblem(`The broker refused the login: ${err.message}`);
        disconnect();
      } else {
        loginProblem(`Connection problem: ${err.message}`);
      }
    });
    client.on("message", onMessage);
  }

  function disconnect() {
    tab.removeItem("mqtt-vllm-worker:autoconnect");
    if (page.client) page.client.end(true);
    page.client = null;
    page.workers.clear();
    renderWorkers();
    setBroker("not connected", "off");
    setReady(false);
  }

  // Subscribe first, publish after: a reply is published once, and one that arrives before the
  // subscription is in place is never delivered to this client.
  function subscribe(client) {
    const wanted = [topic("reply"), topic("stream"), `${page.prefix}/_worker/+/status`];
    client.subscribe(wanted, { qos: 1 }, (err, granted) => {
      if (err) return loginProblem(`Subscribing failed: ${err.message}`);
      const refused = (granted || []).filter((g) => g.qos >= 0x80).map((g) => g.topic);
      if (refused.includes(wanted[0])) return loginProblem(`The broker refused the subscription to ${wanted[0]}`);
      if (client !== page.client) return;
      setReady(true);
      // A request whose reply did not arrive (a reload, a lost connection) is sent again with
      // its requestId: the worker answers it from its store, or joins the running one. Never twice generated.
      for (const turn of page.turns.filter((t) => t.status === "pending")) {
        turn.resumed = true;
        turn.stream = newStream();
        render(turn);
        publishRequest(turn);
      }
    });
  }

  function publishRequest(turn) {
    if (!turn.payload) {
      failTurn(turn, "not_sent", "the page was reloaded before this message with images was answered: send it again");
      return;
    }
    page.client.publish(topic("request"), turn.payload, { qos: 1 }, (err) => {
      if (err) failTurn(turn, err.code === 135 ? "not_authorized" : "publish_failed", err.message);
    });
  }

  function failTurn(turn, code, message) {
    turn.status = "error";
    turn.error = { code, message };
    saveTurns();
    render(turn);
    updateCancel();
  }

  function onMessage(t, payload) {
    const text = decoder.decode(payload);
    const parts = t.split("/");
    if (t.startsWith(`${page.prefix}/_worker/`)) {
      const workerId = parts[parts.length - 2];
      if (text) page.workers.set(workerId, text);
      else page.workers.delete(workerId); // a retained status cleared
      renderWorkers();
      return;
    }
    let body;
    try {
      body = JSON.parse(text);
    } catch {
      return;
    }
    const turn = page.turns.find((x) => x.requestId === body.requestId);
    if (t === topic("stream")) {
      if (!turn || turn.status !== "pending") return; // a late delta of a finished reply
      turn.stream = turn.stream || newStream();
      addDelta(turn.stream, body);
      renderSoon(turn);
      return;
    }
    if (t !== topic("reply")) return;
    if (body.action) {
      if (body.action === "reset" && body.ok) note("The worker forgot this conversation.");
      return;
    }
    if (body.error && !turn) {
      note(`${body.error.code}: ${body.error.message}`, "note error");
      return;
    }
    if (!turn || turn.status !== "pending") return; // a second copy (a resumed request)
    delete turn.stream;
    delete turn.cancelling;
    delete turn.resumed;
    if (body.error) {
      failTurn(turn, body.error.code, body.error.message);
      return;
    }
    Object.assign(turn, {
      status: "done",
      reply: body.reply,
      reasoning: body.reasoning || "",
      finishReason: body.finishReason,
      toolCalls: body.toolCalls,
      workerCalls: body.workerCalls,
      usage: body.usage,
      latency: body.latency,
      roundTripMs: turn.sentAt ? Date.now() - turn.sentAt : undefined,
    });
    // The calls are run and their results sent at once, in the same task as the reply is
    // saved: a reload never finds a reply with calls and no request with their results. Calls
    // the worker asks the user to confirm wait for the buttons (a reload shows them again).
    if (body.toolCalls && body.toolCalls.length && !body.toolCalls.some((c) => c.needsConfirmation)) sendResults(turn);
    saveTurns();
    render(turn);
    updateCancel();
  }

  // Sampling options of the form, for every request of a message.
  function requestOptions(request) {
    const maxTokens = Number($("max-tokens").value);
    if ($("max-tokens").value && Number.isFinite(maxTokens)) request.maxTokens = maxTokens;
    const temperature = Number($("temperature").value);
    if ($("temperature").value && Number.isFinite(temperature)) request.temperature = temperature;
    if ($("system-prompt").value.trim()) request.systemPrompt = $("system-prompt").value;
    return request;
  }

  // Run a reply's calls here and answer them all in one request (toolResults); the model
  // goes on from there, and may call again.
  function sendResults(callTurn) {
    const round = (callTurn.round || 0) + 1;
    const results = callTurn.toolCalls.map((call) =>
      call.needsConfirmation
        ? { toolCallId: call.id, name: call.function.name, approved: callTurn.decisions[call.id] }
        : { toolCallId: call.id, name: call.function.name, content: runTool(call) },
    );
    callTurn.answered = true;
    const request = requestOptions({
      toolResults: results.map(({ toolCallId, content, approved }) => (approved === undefined ? { toolCallId, content } : { toolCallId, approved })),
      requestId: randomId("r-"),
      stream: true,
      includeReasoning: true,
    });
    if (round >= MAX_TOOL_ROUNDS) request.toolChoice = "none";
    const turn = {
      requestId: request.requestId,
      results,
      round,
      payload: JSON.stringify(request),
      status: "pending",
      sentAt: Date.now(),
      stream: newStream(),
    };
    page.turns.push(turn);
    saveTurns();
    render(callTurn);
    render(turn);
    publishRequest(turn);
  }

  // ---- images (docs/protocol.md, "Images"): attached with the file picker or by pasting,
  // sent as OpenAI content parts with data: URLs, shown as thumbnails.
  const IMAGE_TYPES = ["image/jpeg", "image/png", "image/gif", "image/webp", "image/bmp"];
  // What fits the worker's default limit of a request with images (4 MiB) once base64.
  const MAX_IMAGE_BYTES = 3 * 1024 * 1024 - 4096;
  const THUMB_EDGE = 128;
  const attached = []; // {url: the data: URL sent, thumb: a small copy kept with the transcript}

  function thumbnail(src) {
    const img = document.createElement("img");
    img.className = "thumb";
    img.alt = "an image sent with the message";
    img.src = src;
    return img;
  }
  function attachProblem(text) {
    $("attach-problem").textContent = text;
    $("attach-problem").hidden = !text;
  }
  function readAsDataUrl(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }
  // A small JPEG of the image for the transcript (localStorage keeps it across reloads).
  function makeThumb(url) {
    return new Promise((resolve) => {
      const img = new Image();
      img.onload = () => {
        const scale = Math.min(1, THUMB_EDGE / Math.max(img.naturalWidth, img.naturalHeight));
        const canvas = document.createElement("canvas");
        canvas.width = Math.max(1, Math.round(img.naturalWidth * scale));
        canvas.height = Math.max(1, Math.round(img.naturalHeight * scale));
        canvas.getContext("2d").drawImage(img, 0, 0, canvas.width, canvas.height);
        resolve(canvas.toDataURL("image/jpeg", 0.8));
      };
      img.onerror = () => resolve(null);
      img.src = url;
    });
  }
  async function attachFiles(files) {
    attachProblem("");
    for (const file of files) {
      if (!IMAGE_TYPES.includes(file.type)) {
        attachProblem(`${file.name || "the pasted file"} is not a JPEG, PNG, GIF, WebP or BMP image`);
        continue;
      }
      if (file.size > MAX_IMAGE_BYTES) {
        attachProblem(`${file.name || "the pasted image"} is ${file.size} bytes; at most ${MAX_IMAGE_BYTES} go in a message`);
        continue;
      }
      const url = await readAsDataUrl(file);
      const thumb = await makeThumb(url);
      if (!thumb) {
        attachProblem(`${file.name || "the pasted image"} cannot be read as an image`);
        continue;
      }
      attached.push({ url, thumb, name: file.name || "pasted image" });
    }
    renderAttachments();
  }
  function renderAttachments() {
    const box = $("attachments");
    box.replaceChildren(
      ...attached.map((image, index) => {
        const item = document.createElement("span");
        item.className = "attachment";
        item.title = image.name;
        const drop = document.createElement("button");
        drop.type = "button";
        drop.textContent = "×";
        drop.title = "do not send this image";
        drop.addEventListener("click", () => {
          attached.splice(index, 1);
          renderAttachments();
        });
        item.append(thumbnail(image.thumb), drop);
        return item;
      }),
    );
    box.hidden = attached.length === 0;
  }

  // ---- actions
  function send() {
    const message = $("message").value;
    const images = attached.splice(0);
    if (!page.ready || (!message.trim() && !images.length)) {
      attached.push(...images);
      return;
    }
    // Always a requestId of our own: the idempotency key (a redelivered or re-sent request is
    // answered from the worker's store) and how replies, deltas and cancels find their turn.
    const request = requestOptions({ message, requestId: randomId("r-"), stream: true, includeReasoning: true });
    if (images.length) {
      // Content parts: the images, then the text.
      request.message = [
        ...images.map((image) => ({ type: "image_url", image_url: { url: image.url } })),
        ...(message ? [{ type: "text", text: message }] : []),
      ];
    }
    // The page's tools, or none ([] clears what an earlier message offered).
    const offered = $("offer-time-tool").checked;
    request.tools = offered ? [LOCAL_TIME_TOOL] : [];
    // The worker's own tools: every one this user may use, or none ([] clears the session's).
    const workerTools = $("use-worker-tools").checked;
    request.workerTools = workerTools ? ["*"] : [];
    const choice = $("tool-choice").value;
    if ((offered || workerTools) && choice !== "auto") {
      if (choice === "none" || choice === "required") request.toolChoice = choice;
      else {
        const name = choice === "named" ? $("forced-tool-name").value.trim() : offered ? choice : "";
        if (name) request.toolChoice = { type: "function", function: { name } };
      }
    }
    const turn = {
      requestId: request.requestId,
      message,
      thumbs: images.map((image) => image.thumb),
      payload: JSON.stringify(request),
      status: "pending",
      sentAt: Date.now(),
      stream: newStream(),
    };
    page.turns.push(turn);
    saveTurns();
    render(turn);
    atEnd = true; // one's own message: always show it, and what follows
    $("message").value = "";
    renderAttachments();
    updateCancel();
    publishRequest(turn);
  }

  function cancel() {
    for (const turn of page.turns.filter((t) => t.status === "pending")) {
      turn.cancelling = true;
      render(turn);
      page.client.publish(topic("control"), JSON.stringify({ action: "cancel", requestId: turn.requestId }), { qos: 1 });
    }
  }

  function reset() {
    page.client.publish(topic("control"), JSON.stringify({ action: "reset" }), { qos: 1 });
    page.turns = [];
    local.removeItem(transcriptKey());
    redraw();
  }

  function newSession() {
    $("session-id").value = randomId("web-");
    if (page.client) {
      disconnect();
      connect();
    } else {
      page.turns = [];
      redraw();
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    const box = $("transcript");
    box.addEventListener("scroll", () => {
      atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    });
    initFields();
    renderWorkers();
    $("login-form").addEventListener("submit", (e) => {
      e.preventDefault();
      if (!page.client) connect();
    });
    $("disconnect").addEventListener("click", disconnect);
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      send();
    });
    $("message").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        send();
      }
    });
    $("attach").addEventListener("click", () => $("image-file").click());
    $("image-file").addEventListener("change", (e) => {
      attachFiles(Array.from(e.target.files));
      e.target.value = ""; // the same file again is a change too
    });
    $("message").addEventListener("paste", (e) => {
      const files = Array.from(e.clipboardData ? e.clipboardData.files : []);
      if (files.length) {
        e.preventDefault(); // an image, not its name, goes with the message
        attachFiles(files);
      }
    });
    $("cancel").addEventListener("click", cancel);
    $("reset").addEventListener("click", reset);
    $("new-session").addEventListener("click", newSession);
    // A reload in this tab reconnects by itself and resumes the session.
    if (tab.getItem("mqtt-vllm-worker:autoconnect") && $("username").value) connect();
  });
})();
