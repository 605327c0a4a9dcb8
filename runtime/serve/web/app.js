// The chat page of `runtime serve`: plain JavaScript over the server's own API (the same
// endpoints any client uses), served from the package, no network but the server.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("runtime-api-key") || "", base: null, chat: false, adapters: [],
                scales: new Map(), chosen: new Set(), messages: [], controller: null };

function headers(json) {
  const result = json ? { "Content-Type": "application/json" } : {};
  if (state.key) result.Authorization = `Bearer ${state.key}`;
  return result;
}

async function api(path, body) {
  const response = await fetch(path, body === undefined ? { headers: headers(false) }
    : { method: "POST", headers: headers(true), body: JSON.stringify(body) });
  if (response.status === 401) {
    $("key-form").hidden = false;
    throw new Error("this server needs its API key");
  }
  if (!response.ok) throw new Error(await errorMessage(response));
  return path === "/metrics" ? response.text() : response.json();
}

async function errorMessage(response) {
  try {
    return (await response.json()).error.message;
  } catch {
    return `HTTP ${response.status}`;
  }
}

function status(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function element(tag, props = {}, ...children) {
  const { dataset = {}, ...rest } = props;
  const node = Object.assign(document.createElement(tag), rest);
  Object.assign(node.dataset, dataset);
  node.append(...children);
  return node;
}

async function refresh() {
  try {
    const models = await api("/v1/models");
    $("key-form").hidden = !state.key;
    state.base = models.data.find((card) => card.parent === null);
    state.chat = Boolean(state.base.chat_template);
    state.adapters = models.data.filter((card) => card.parent !== null);
    $("model-info").textContent = `model ${state.base.id} · context ${state.base.max_model_len} tokens · ` +
      (state.chat ? "chat template" : "no chat template: plain completion");
    renderAdapters();
    renderFiles((await api("/v1/adapter_files")).data);
    status("connected");
  } catch (error) {
    status(error.message, true);
  }
}

function renderAdapters() {
  const names = new Set(state.adapters.map((card) => card.id));
  for (const name of [...state.chosen]) if (!names.has(name)) state.chosen.delete(name);
  const list = $("adapters");
  list.replaceChildren(...state.adapters.map((card) => {
    const scale = state.scales.get(card.id) ?? 1;
    const tick = element("input", { type: "checkbox", checked: state.chosen.has(card.id), id: `use-${card.id}` });
    tick.addEventListener("change", () => { tick.checked ? state.chosen.add(card.id) : state.chosen.delete(card.id); });
    const shown = element("output", { textContent: scale.toFixed(2) });
    const slider = element("input", { type: "range", min: "-2", max: "2", step: "0.05", value: String(scale),
                                      id: `scale-${card.id}`, ariaLabel: `scale of ${card.id}` });
    slider.addEventListener("input", () => {
      state.scales.set(card.id, Number(slider.value));
      shown.textContent = Number(slider.value).toFixed(2);
    });
    const unload = element("button", { type: "button", textContent: "Unload" });
    unload.addEventListener("click", () => act(unload, "/v1/unload_lora_adapter", { lora_name: card.id }));
    const row = element("div", { className: "row" }, tick,
                        element("label", { htmlFor: tick.id, className: "name", textContent: card.id }), unload);
    const item = element("li", { dataset: { adapter: card.id } }, row,
                         element("div", { className: "scale" }, "scale", slider, shown));
    if (!card.healthy) item.append(element("div", { className: "unhealthy", textContent: `unhealthy: ${card.problem}` }));
    return item;
  }));
  if (!state.adapters.length) list.append(element("li", { className: "hint", textContent: "none loaded" }));
}

function renderFiles(files) {
  const list = $("files");
  list.replaceChildren(...files.filter((file) => !file.loaded).map((file) => {
    const load = element("button", { type: "button", textContent: "Load" });
    load.addEventListener("click", () => act(load, "/v1/load_lora_adapter", { lora_name: file.name, lora_path: file.file }));
    return element("li", { dataset: { file: file.file } },
                   element("div", { className: "row" }, element("span", { className: "name", textContent: file.file }), load));
  }));
  if (!list.children.length) list.append(element("li", { className: "hint", textContent: "every file is loaded" }));
}

async function act(button, path, body) {
  button.disabled = true;
  try {
    await api(path, body);
  } catch (error) {
    status(error.message, true);
  }
  await refresh();
}

function blend() {
  return state.adapters.filter((card) => state.chosen.has(card.id))
    .map((card) => ({ name: card.id, scale: state.scales.get(card.id) ?? 1 }));
}

function request(text) {
  const body = { model: state.base.id, stream: true, stream_options: { include_usage: true },
                 temperature: Number($("temperature").value || 0) };
  const lora = blend();
  if (lora.length) body.lora = lora;
  const limit = $("max-tokens").value;
  if (limit) body.max_tokens = Number(limit);
  if (state.chat) return ["/v1/chat/completions", { ...body, messages: [...state.messages, { role: "user", content: text }] }];
  return ["/v1/completions", { ...body, prompt: text }];
}

async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

function bubble(role, text) {
  const item = element("li", { className: role }, element("span", { className: "who", textContent: role }),
                       element("span", { className: "text", textContent: text }));
  $("log").append(item);
  item.scrollIntoView({ block: "end" });
  return item.querySelector(".text");
}

async function send(text) {
  const [path, body] = request(text);
  if (!state.chat && !$("max-tokens").value) {  // a completion gets the room its prompt leaves
    const counted = await api("/tokenize", { model: state.base.id, prompt: text });
    body.max_tokens = Math.max(1, counted.max_model_len - counted.count);
  }
  bubble("user", text);
  const out = bubble("assistant", "");
  out.parentElement.dataset.state = "streaming";
  for (const id of ["ttft", "speed", "tokens", "resident"]) $(id).textContent = "…";
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let first = null;
  let usage = null;
  let timings = null;
  let answer = "";
  try {
    const response = await fetch(path, { method: "POST", headers: headers(true), body: JSON.stringify(body),
                                         signal: state.controller.signal });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      if (chunk.timings) timings = chunk.timings;
      const choice = chunk.choices[0];
      const delta = choice ? (state.chat ? choice.delta.content : choice.text) : "";
      if (delta) {
        first ??= performance.now();
        answer += delta;
        out.textContent = answer;
      }
    }
    if (state.chat) state.messages.push({ role: "user", content: text }, { role: "assistant", content: answer });
  } catch (error) {
    if (error.name !== "AbortError") {
      out.parentElement.className = "error";
      out.textContent = error.message;
    }
  } finally {
    const ended = performance.now();
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    out.parentElement.dataset.state = "done";
    showStats(started, first, usage, timings);
  }
}

// Tokens/s is the server's own decode pace (its timings: generated tokens after the first
// over the time they took), not the browser's arrival times: deltas arrive in bursts, and
// the last ones can come within a millisecond of the first.
async function showStats(started, first, usage, timings) {
  $("ttft").textContent = first === null ? "–" : `${Math.round(first - started)} ms`;
  const tokens = usage ? usage.completion_tokens : null;
  $("tokens").textContent = tokens === null ? "–" : String(tokens);
  $("speed").textContent = timings && timings.predicted_per_second > 0 ? timings.predicted_per_second.toFixed(1) : "–";
  const names = blend().map((entry) => entry.name);
  if (!names.length) {
    $("resident").textContent = "base model only";
    return;
  }
  try {
    const metrics = await api("/metrics");
    $("resident").textContent = names.map((name) => `${name}: ${formatBytes(residentBytes(metrics, name))}`).join(", ");
  } catch (error) {
    $("resident").textContent = "–";
  }
}

function residentBytes(metrics, name) {
  for (const line of metrics.split("\n")) {
    if (line.startsWith(`runtime_adapter_resident_bytes{adapter="${name}"}`)) return Number(line.split(" ").pop());
  }
  return null;
}

function formatBytes(value) {
  if (value === null) return "–";
  return value >= 1 << 20 ? `${(value / (1 << 20)).toFixed(1)} MiB` : `${(value / 1024).toFixed(1)} KiB`;
}

$("compose").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("message").value;
  if (!text.trim() || state.controller || !state.base) return;
  $("message").value = "";
  send(text);
});
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("compose").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller?.abort());
$("clear").addEventListener("click", () => {
  state.messages = [];
  $("log").replaceChildren();
});
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("api-key").value;
  sessionStorage.setItem("runtime-api-key", state.key);
  refresh();
});
refresh();
