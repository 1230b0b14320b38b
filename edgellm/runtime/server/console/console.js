// edgellm console: plain JavaScript, no build step, no third-party code. Everything the node sends is
// shown with textContent (never parsed as HTML), so a hostile prompt or answer stays text.
"use strict";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "edgellm.console.token";
const POLL_MS = 1000; // at most one status refresh a second
const RATE_WINDOW_S = 5; // tokens/s is measured over this window (the worker reports every ~2 s)
const CHART_SPAN_S = 60;

const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || "",
  model: null,
  tab: "status",
  ready: false,
  samples: [], // [{t, generated}] from /metrics, for tokens/s
  rates: [], // [{t, rate}] for the chart
  abort: null,
  lastBody: null,
};

class ApiError extends Error {
  constructor(status, body) {
    super(errorText(body) || `HTTP ${status}`);
    this.status = status;
  }
}

function errorText(body) {
  if (!body || typeof body !== "object") return "";
  const err = body.error;
  if (typeof err === "string") return err;
  if (err && typeof err.message === "string") return err.message;
  return "";
}

// WRAPPED bodies put the answer under "result" next to the node keys; RAW ones are the answer.
function unwrap(json) {
  return json && typeof json === "object" && "server_node_addr" in json && "result" in json ? json.result : json;
}

function authHeaders(extra = {}) {
  return state.token ? { ...extra, Authorization: `Bearer ${state.token}` } : extra;
}

async function api(path, options = {}) {
  const init = { ...options, headers: authHeaders(options.headers || {}) };
  if (options.json !== undefined) {
    init.method = init.method || "POST";
    init.body = JSON.stringify(options.json);
    init.headers["Content-Type"] = "application/json";
  }
  const res = await fetch(path, init);
  let body = null;
  try {
    body = unwrap(await res.json());
  } catch (_) {
    body = null;
  }
  if (res.status === 401) {
    showLogin("The token was refused.");
  }
  if (!res.ok) throw new ApiError(res.status, body);
  return body;
}

// -- login and tabs -----------------------------------------------------------------------------
function showLogin(message) {
  state.ready = false;
  for (const id of ["status", "playground", "requests"]) $(id).hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = state.token ? message || "" : "";
  setConn("locked");
  $("token").focus();
}

let openRetry = 1000;

async function open() {
  try {
    const models = await api("/v1/models");
    state.model = models.data[0].id;
  } catch (err) {
    if (err.status !== 401) {
      // A node that is restarting answers again soon: retry, backing off to every 30 s.
      setConn(`node unreachable: ${err.message}; retrying`);
      setTimeout(open, openRetry);
      openRetry = Math.min(30000, openRetry * 2);
    }
    return;
  }
  openRetry = 1000;
  state.ready = true;
  $("login").hidden = true;
  $("model-name").textContent = state.model;
  selectTab(state.tab);
  poll();
}

function selectTab(name) {
  if (name !== "requests") watching += 1;
  state.tab = name;
  for (const tab of document.querySelectorAll(".tab")) {
    const on = tab.getAttribute("aria-controls") === name;
    tab.setAttribute("aria-selected", String(on));
    $(tab.getAttribute("aria-controls")).hidden = !on || !state.ready;
  }
  if (name === "requests" && state.ready) loadRequests();
}

// -- status -------------------------------------------------------------------------------------
let pollTimer = null;
let polling = false; // one refresh chain at a time (visibility changes and logins may call poll again)

async function poll() {
  clearTimeout(pollTimer);
  if (polling) return;
  polling = true;
  try {
    if (state.ready && !document.hidden) {
      const [status, metrics] = await Promise.all([api("/status"), api("/metrics")]);
      renderStatus(status, metrics);
      setConn("live");
      $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    }
  } catch (err) {
    if (err.status !== 401) setConn(`status unavailable: ${err.message}`);
  } finally {
    polling = false;
  }
  // Idle tabs cost nothing: a hidden page does not poll (the visibility listener restarts it).
  if (state.ready && !document.hidden) pollTimer = setTimeout(poll, POLL_MS);
}

// The live region announces changes of the connection only, not every refresh.
function setConn(text) {
  if ($("conn").textContent !== text) $("conn").textContent = text;
}

function fmt(value, digits = 1) {
  return typeof value === "number" && Number.isFinite(value) ? value.toFixed(digits) : "-";
}

function duration(seconds) {
  const s = Math.floor(seconds || 0);
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  return d ? `${d}d ${h}h` : h ? `${h}h ${m}m` : `${m}m ${s % 60}s`;
}

function fillList(dl, pairs) {
  dl.replaceChildren();
  for (const [key, value] of pairs) {
    const dt = document.createElement("dt");
    dt.textContent = key;
    const dd = document.createElement("dd");
    dd.textContent = value;
    dl.append(dt, dd);
  }
}

function renderStatus(status, metrics) {
  const offload = status.offload || {};
  const load = status.load || {};
  $("s-model").textContent = status.model || "-";
  const layers = offload.n_layers !== undefined ? ` (${offload.n_gpu_layers} of ${offload.n_layers} layers on the GPU)` : "";
  $("s-device").textContent = `${offload.device || "?"}${layers}${offload.fallback_reason ? ` · ${offload.fallback_reason}` : ""}`;
  $("s-busy").textContent = load.slots_busy ?? "-";
  $("s-slots").textContent = load.slots_total ?? (status.engine_info || {}).n_slots ?? "-";
  $("s-waiting").textContent = load.waiting ?? "-";
  $("s-inflight").textContent = status.in_flight ?? "-";
  $("s-ttft50").textContent = fmt((metrics.ttft_ms || {}).p50, 0);
  $("s-ttft95").textContent = fmt((metrics.ttft_ms || {}).p95, 0);
  $("s-lat50").textContent = fmt((metrics.latency_ms || {}).p50, 0);
  $("s-lat95").textContent = fmt((metrics.latency_ms || {}).p95, 0);
  $("s-uptime").textContent = duration(status.uptime_s);
  $("s-restarts").textContent = metrics.engine_restarts ?? "-";
  const counts = status.registry || {};
  $("s-counts").textContent = ["pending", "completed", "failed", "timeout"].map((k) => `${k} ${counts[k] || 0}`).join(", ");
  renderMemory(status);
  renderBoard(status.board);
  trackRate((metrics.engine || {}).generated_tokens);
}

function renderMemory(status) {
  const pairs = [];
  const plan = status.memory_plan;
  if (plan) {
    pairs.push(["weights", `${fmt(plan.weights_mib)} MiB`], ["KV cache", `${fmt(plan.kv_mib)} MiB (${plan.kv_type})`]);
    pairs.push(["compute", `${fmt(plan.compute_mib)} MiB`], ["planned", `${fmt(plan.total_mib)} of ${fmt(plan.budget_mib)} MiB`]);
  }
  const proc = status.process_memory || {};
  if (proc.api_rss_mib !== undefined) pairs.push(["API process", `${fmt(proc.api_rss_mib)} MiB`]);
  if (proc.worker_rss_mib !== undefined) pairs.push(["engine worker", `${fmt(proc.worker_rss_mib)} MiB`]);
  const gpu = status.gpu_memory;
  if (gpu) pairs.push([gpu.source === "jetson" ? "unified memory free" : "GPU memory free", `${gpu.free_mb} of ${gpu.total_mb} MB`]);
  fillList($("s-memory"), pairs.length ? pairs : [["memory", "not reported"]]);
}

function renderBoard(board) {
  if (!board || !Object.keys(board).length) {
    fillList($("s-board"), [["telemetry", "none on this machine"]]);
    return;
  }
  const pairs = [];
  if (board.model) pairs.push(["board", board.model]);
  if (board.power_mode) pairs.push(["power mode", `${board.power_mode.name || ""} (${board.power_mode.id})`]);
  const gpu = board.gpu || {};
  if (gpu.load_percent !== undefined) pairs.push(["GPU load", `${fmt(gpu.load_percent)} %`]);
  if (gpu.freq_mhz !== undefined) pairs.push(["GPU clock", `${fmt(gpu.freq_mhz, 0)} MHz`]);
  for (const [zone, c] of Object.entries(board.temperatures_c || {})) pairs.push([zone, `${fmt(c)} °C`]);
  for (const [rail, mw] of Object.entries(board.power_mw || {})) pairs.push([rail, `${fmt(mw / 1000, 2)} W`]);
  fillList($("s-board"), pairs);
}

function trackRate(generated) {
  if (typeof generated !== "number") return;
  const now = Date.now() / 1000;
  const last = state.samples[state.samples.length - 1];
  if (last && generated < last.generated) state.samples = []; // the worker restarted: its counters too
  state.samples.push({ t: now, generated });
  state.samples = state.samples.filter((s) => now - s.t <= CHART_SPAN_S + RATE_WINDOW_S);
  const base = state.samples.find((s) => now - s.t <= RATE_WINDOW_S) || state.samples[0];
  const rate = now - base.t > 0.5 ? (generated - base.generated) / (now - base.t) : 0;
  state.rates.push({ t: now, rate });
  state.rates = state.rates.filter((r) => now - r.t <= CHART_SPAN_S);
  $("s-tps").textContent = fmt(rate);
  const top = Math.max(1, ...state.rates.map((r) => r.rate));
  $("s-line").setAttribute(
    "points",
    state.rates.map((r) => `${(300 * (1 - (now - r.t) / CHART_SPAN_S)).toFixed(1)},${(58 - (56 * r.rate) / top).toFixed(1)}`).join(" "),
  );
}

// -- playground ---------------------------------------------------------------------------------
function buildBody() {
  const messages = [];
  const system = $("p-system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push({ role: "user", content: $("p-user").value });
  const body = {
    model: state.model,
    messages,
    temperature: Number($("p-temperature").value),
    max_tokens: Number($("p-max-tokens").value),
    top_p: Number($("p-top-p").value),
  };
  if ($("p-seed").value !== "") body.seed = Number($("p-seed").value);
  const kind = $("p-guide").value;
  const spec = $("p-spec").value;
  if (kind === "json_schema") {
    let schema;
    try {
      schema = JSON.parse(spec);
    } catch (err) {
      throw new Error(`the schema is not JSON: ${err.message}`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
  } else if (kind === "json_object") {
    body.response_format = { type: "json_object" };
  } else if (kind === "choice") {
    body.guided_decoding = { choice: spec.split("\n").map((s) => s.trim()).filter(Boolean) };
  } else if (kind) {
    body.guided_decoding = { [kind]: spec };
  }
  addTool(body);
  return body;
}

// The playground's one tool, when a tool choice is picked. A definition that cannot be sent is said next
// to its field (InlineError), not thrown at the user.
class InlineError extends Error {}

function toolProblem(message, field) {
  say("p-tool-error", message, "bad");
  $(field).setAttribute("aria-invalid", "true");
  $(field).focus();
  return new InlineError(message);
}

function clearToolProblem() {
  say("p-tool-error", "", "bad");
  for (const id of ["p-tool-name", "p-tool-params"]) $(id).removeAttribute("aria-invalid");
}

function toolParameters() {
  let parameters;
  try {
    parameters = JSON.parse($("p-tool-params").value);
  } catch (err) {
    throw toolProblem(`The tool's parameters are not JSON: ${err.message}`, "p-tool-params");
  }
  if (!parameters || typeof parameters !== "object" || Array.isArray(parameters)) {
    throw toolProblem("The tool's parameters must be a JSON object (a JSON schema).", "p-tool-params");
  }
  return parameters;
}

function addTool(body) {
  clearToolProblem();
  const choice = $("p-tool-choice").value;
  if (!choice) return;
  const name = $("p-tool-name").value.trim();
  if (!name) throw toolProblem("The tool needs a name.", "p-tool-name");
  const fn = { name };
  const description = $("p-tool-desc").value.trim();
  if (description) fn.description = description;
  fn.parameters = toolParameters();
  body.tools = [{ type: "function", function: fn }];
  body.tool_choice = choice === "named" ? { type: "function", function: { name } } : choice;
  body.parallel_tool_calls = $("p-tool-parallel").checked;
}

function toolChoiceText(choice) {
  return typeof choice === "string" ? choice : `function ${choice.function.name}`;
}

function say(id, text, cls = "") {
  const el = $(id);
  el.textContent = text;
  el.className = cls;
}

async function checkRequest() {
  const body = freshBody();
  if (!body) return;
  try {
    const res = await api("/console/api/check", { json: body });
    const notes = [];
    if (res.guide) notes.push(`constraint: ${res.guide}`);
    if (body.tools) notes.push(`tool ${body.tools[0].function.name}, tool_choice ${toolChoiceText(body.tool_choice)}`);
    say("p-check-result", `The node accepts this request${notes.length ? ` (${notes.join("; ")})` : ""}.`, "good");
  } catch (err) {
    say("p-check-result", `Refused: ${err.message}`, "bad");
  }
}

async function send(event) {
  event.preventDefault();
  const body = freshBody();
  if (!body) return;
  const stream = $("p-stream").checked;
  state.lastBody = body;
  say("p-output", "");
  say("p-meta", "");
  say("p-valid", "");
  showReasoning("");
  renderCalls([]);
  state.abort = new AbortController();
  $("p-send").disabled = true;
  $("p-stop").disabled = false;
  const started = performance.now();
  $("p-output").setAttribute("aria-busy", "true");
  let text = "";
  let reasoning = "";
  let calls = [];
  let finish = null;
  let usage = null;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(stream ? { ...body, stream: true, stream_options: { include_usage: true } } : body),
      signal: state.abort.signal,
    });
    if (res.status === 401) showLogin("The token was refused.");
    if (!res.ok) {
      let err = null;
      try { err = await res.json(); } catch (_) { /* not JSON */ }
      throw new ApiError(res.status, err);
    }
    if (stream) {
      ({ text, reasoning, calls, finish, usage } = await readStream(res, {
        text: (all) => { $("p-output").textContent = all; },
        reasoning: showReasoning,
        calls: (all) => renderCalls(all, false),
      }));
    } else {
      const json = await res.json();
      const message = json.choices[0].message;
      text = message.content || "";
      reasoning = message.reasoning_content || "";
      calls = message.tool_calls || [];
      finish = json.choices[0].finish_reason;
      usage = json.usage;
      $("p-output").textContent = text;
      showReasoning(reasoning);
    }
    renderCalls(calls, true);
    const seconds = (performance.now() - started) / 1000;
    const tokens = usage ? usage.completion_tokens : null;
    const thought = ((usage || {}).completion_tokens_details || {}).reasoning_tokens;
    say("p-meta", `finish: ${finish || "?"} · ${tokens ?? "?"} tokens in ${seconds.toFixed(2)} s` +
      (tokens ? ` (${(tokens / seconds).toFixed(1)} tok/s)` : "") +
      (thought ? ` · ${thought} reasoning tokens` : "") +
      (calls.length ? ` · ${calls.length} tool call${calls.length > 1 ? "s" : ""}` : ""));
    // A tool call answers instead of text: the text's constraint is then not the thing to check.
    if ((body.response_format || body.guided_decoding) && !(calls.length && !text)) await validate(body, text);
    if (calls.length && body.tools) await validateCalls(body, calls);
  } catch (err) {
    say("p-meta", err.name === "AbortError" ? "stopped" : `failed: ${err.message}`, err.name === "AbortError" ? "" : "bad");
  } finally {
    $("p-send").disabled = false;
    $("p-stop").disabled = true;
    $("p-output").setAttribute("aria-busy", "false");
    state.abort = null;
  }
}

// Server-sent events of /v1/chat/completions: "data: {chunk}" lines, then "data: [DONE]". `on` gets the
// text, the reasoning and the tool calls so far, each time one grows.
async function readStream(res, on) {
  const reader = res.body.getReader();
  try {
    return await readEvents(reader, on);
  } finally {
    reader.cancel().catch(() => {}); // an error event or a bad chunk: the node stops generating
  }
}

async function readEvents(reader, on) {
  const decoder = new TextDecoder();
  let buffer = "";
  let text = "";
  let reasoning = "";
  const calls = []; // by the deltas' index, as the openai client accumulates them
  let finish = null;
  let usage = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the stream ended before its end marker ([DONE])");
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return { text, reasoning, calls: calls.filter(Boolean), finish, usage };
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "generation failed");
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          if (delta.content) {
            text += delta.content;
            on.text(text);
          }
          if (delta.reasoning_content) {
            reasoning += delta.reasoning_content;
            on.reasoning(reasoning);
          }
          if (Array.isArray(delta.tool_calls) && delta.tool_calls.length) {
            for (const part of delta.tool_calls) addCallDelta(calls, part);
            on.calls(calls.filter(Boolean));
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
  }
}

function addCallDelta(calls, part) {
  const index = Number.isInteger(part.index) ? part.index : calls.length;
  const call = calls[index] || (calls[index] = { id: "", type: "function", function: { name: "", arguments: "" } });
  if (part.id) call.id = part.id;
  if (part.type) call.type = part.type;
  const fn = part.function || {};
  if (typeof fn.name === "string") call.function.name += fn.name;
  if (typeof fn.arguments === "string") call.function.arguments += fn.arguments;
}

function showReasoning(text) {
  $("p-reasoning").textContent = text.replace(/^\s+/, ""); // templates open the block with a newline
  $("p-reasoning-box").hidden = !text;
}

// Tool calls, apart from the text: the function's name, then its arguments (pretty-printed once they
// are whole JSON; as they came while they stream, or when they do not parse).
function renderCalls(calls, done = true) {
  const list = $("p-calls");
  $("p-calls-box").hidden = !calls.length;
  while (list.children.length > calls.length) list.lastElementChild.remove();
  calls.forEach((call, i) => {
    const item = list.children[i] || list.appendChild(callItem());
    const fn = call.function || {};
    item.querySelector(".call-name").textContent = fn.name || "?";
    item.querySelector(".call-id").textContent = call.id ? ` · ${call.id}` : "";
    const args = fn.arguments ?? "";
    let shown = args;
    let note = "";
    try {
      shown = JSON.stringify(JSON.parse(args), null, 2);
    } catch (_) {
      if (done) note = "The arguments are not JSON.";
    }
    item.querySelector(".call-args").textContent = shown;
    verdict(item.querySelector(".call-valid"), note, "bad");
  });
}

function verdict(el, text, cls) {
  el.textContent = text;
  el.className = `call-valid ${cls}`;
}

function callItem() {
  const li = document.createElement("li");
  const head = document.createElement("p");
  head.className = "call-head";
  const name = document.createElement("code");
  name.className = "call-name";
  const id = document.createElement("span");
  id.className = "call-id muted";
  head.append(name, id);
  const args = document.createElement("pre");
  args.className = "call-args";
  args.tabIndex = 0;
  const check = document.createElement("p");
  check.className = "call-valid";
  li.append(head, args, check);
  return li;
}

// Each call of the playground's tool, checked by the node against the tool's parameters schema.
async function validateCalls(body, calls) {
  const tool = body.tools[0].function;
  const items = $("p-calls").children;
  for (const [i, call] of calls.slice(0, 16).entries()) {
    const fn = call.function || {};
    const el = items[i] && items[i].querySelector(".call-valid");
    if (!el || el.textContent) continue; // not JSON: already said
    if (fn.name !== tool.name) {
      verdict(el, `NOT valid: no tool is named ${fn.name}`, "bad");
      continue;
    }
    const request = {
      model: body.model,
      messages: [{ role: "user", content: "tool arguments" }],
      response_format: { type: "json_schema", json_schema: { name: "tool_arguments", schema: tool.parameters } },
    };
    try {
      const res = await api("/console/api/validate", { json: { request, text: fn.arguments } });
      const word = res.valid === true ? "valid" : res.valid === false ? "NOT valid" : "not checked";
      verdict(el, `Arguments ${word}: ${res.detail}`, res.valid === true ? "good" : res.valid === false ? "bad" : "muted");
    } catch (err) {
      verdict(el, `validation unavailable: ${err.message}`, "bad");
    }
  }
}

async function validate(body, text) {
  try {
    const res = await api("/console/api/validate", { json: { request: body, text } });
    const verdict = res.valid === true ? "valid" : res.valid === false ? "NOT valid" : "not checked";
    say("p-valid", `Output ${verdict}: ${res.detail}`, res.valid === true ? "good" : res.valid === false ? "bad" : "muted");
  } catch (err) {
    say("p-valid", `validation unavailable: ${err.message}`, "bad");
  }
}

function shellQuote(s) {
  return `'${s.replace(/'/g, `'\\''`)}'`;
}

function copyText(text) {
  $("p-copied").value = text;
  if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(text).catch(() => {});
}

// The form's request, or null after saying what is wrong with it (e.g. a schema that is not JSON).
function freshBody() {
  try {
    return buildBody();
  } catch (err) {
    // A tool problem is said next to its field; the rest here.
    say("p-check-result", err instanceof InlineError ? "" : err.message, "bad");
    return null;
  }
}

// What the copy buttons give: the request last sent, else the form's.
function currentBody() {
  return state.lastBody || freshBody();
}

const EXTRA_FIELDS = [
  "guided_decoding", "top_k", "min_p", "repeat_penalty", "timeout",
  "reasoning_format", "chat_template_kwargs", "thinking_budget_tokens", "thinking_budget_message",
];

function copyCurl() {
  const body = currentBody();
  if (!body) return;
  const auth = state.token ? ` \\\n  -H "Authorization: Bearer $EDGELLM_TOKEN"` : "";
  copyText(`curl -s ${location.origin}/v1/chat/completions \\\n  -H 'Content-Type: application/json'${auth} \\\n  -d ${shellQuote(JSON.stringify(body))}`);
}

function copyPython() {
  const body = currentBody();
  if (!body) return;
  copyText([
    "import json, os",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url=${JSON.stringify(location.origin + "/v1")}, api_key=os.environ.get("EDGELLM_TOKEN", "unused"))`,
    `body = json.loads(${JSON.stringify(JSON.stringify(body))})`,
    "# edgellm's own fields go through extra_body",
    `extra = {k: body.pop(k) for k in ${JSON.stringify(EXTRA_FIELDS)} if k in body}`,
    "reply = client.chat.completions.create(**body, extra_body=extra)",
    "message = reply.choices[0].message",
    "print(message.tool_calls or message.content)",
  ].join("\n"));
}

function copyJsonLine() {
  const body = currentBody();
  if (!body) return;
  const { model, ...rest } = body;
  copyText(JSON.stringify({ id: `playground-${Date.now()}`, ...rest }));
}

async function submitAsync() {
  const body = freshBody();
  if (!body) return;
  const { model, ...seedBody } = body; // the seed endpoints take the same fields, without `model`
  try {
    const ack = await api("/create_chat_completion_async", { json: seedBody });
    say("p-check-result", `Submitted ${ack.request_id}; following it under Requests.`, "good");
    selectTab("requests");
    watch(ack.request_id);
  } catch (err) {
    say("p-check-result", `Refused: ${err.message}`, "bad");
  }
}

// -- requests -----------------------------------------------------------------------------------
async function loadRequests(event) {
  if (event) event.preventDefault();
  const status = $("r-status").value;
  const filter = $("r-text").value.trim();
  try {
    const res = await api(`/console/api/requests?limit=100${status ? `&status=${encodeURIComponent(status)}` : ""}`);
    const rows = res.requests.filter((r) => !filter || r.request_id.includes(filter));
    $("r-rows").replaceChildren(...rows.map(requestRow));
  } catch (err) {
    $("r-detail").textContent = `could not list requests: ${err.message}`;
  }
}

function requestRow(r) {
  const tr = document.createElement("tr");
  const idCell = document.createElement("td");
  const button = document.createElement("button");
  button.type = "button";
  button.textContent = r.request_id;
  button.addEventListener("click", () => {
    watching += 1; // the user chose another request: stop following the submitted one
    showRequest(r.request_id);
  });
  idCell.append(button);
  const cells = [
    r.mode,
    r.status,
    new Date(r.created_at * 1000).toLocaleTimeString(),
    r.prompt_tokens !== null && r.prompt_tokens !== undefined ? `${r.prompt_tokens} / ${r.completion_tokens}` : "-",
    fmt(r.ttft_ms, 0),
    r.error ? `${r.error_type}: ${r.error}` : r.finish_reason || "-",
  ].map((text) => {
    const td = document.createElement("td");
    td.textContent = text;
    return td;
  });
  cells[1].className = r.status === "completed" ? "good" : r.status === "pending" ? "" : "bad";
  tr.append(idCell, ...cells);
  return tr;
}

async function showRequest(id) {
  try {
    const rec = await api(`/request_status?request_id=${encodeURIComponent(id)}&return_full=true`);
    $("r-detail").textContent = JSON.stringify(rec, null, 2);
    return rec;
  } catch (err) {
    $("r-detail").textContent = `${id}: ${err.message}`;
    return null;
  }
}

let watching = 0; // the current watch; a new watch, a row click or leaving the tab ends the old one
const WATCH_LIMIT_S = 3600;

async function watch(id) {
  const mine = ++watching;
  const until = Date.now() + 1000 * WATCH_LIMIT_S;
  while (mine === watching && Date.now() < until) {
    if (!document.hidden && state.tab === "requests") {
      const rec = await showRequest(id);
      if (mine !== watching) return;
      if (!rec || rec.status !== "pending") {
        await loadRequests();
        return;
      }
    }
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
}

// -- wiring -------------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => selectTab(tab.getAttribute("aria-controls")));
  }
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    state.token = $("token").value.trim();
    sessionStorage.setItem(TOKEN_KEY, state.token);
    open();
  });
  $("chat").addEventListener("submit", send);
  $("p-check").addEventListener("click", checkRequest);
  $("p-stop").addEventListener("click", () => state.abort && state.abort.abort());
  $("copy-curl").addEventListener("click", copyCurl);
  $("copy-python").addEventListener("click", copyPython);
  $("copy-jsonl").addEventListener("click", copyJsonLine);
  $("p-async").addEventListener("click", submitAsync);
  $("filters").addEventListener("submit", loadRequests);
  for (const id of ["p-system", "p-user", "p-temperature", "p-max-tokens", "p-top-p", "p-seed", "p-guide", "p-spec",
    "p-tool-choice", "p-tool-name", "p-tool-desc", "p-tool-params", "p-tool-parallel"]) {
    $(id).addEventListener("input", () => { state.lastBody = null; });
  }
  for (const id of ["p-tool-name", "p-tool-params"]) {
    $(id).addEventListener("input", () => {
      if ($(id).getAttribute("aria-invalid")) clearToolProblem();
    });
  }
  document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });
  open();
});
