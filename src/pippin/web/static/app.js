// pippin's page: polls /metrics (Prometheus text) for live numbers and chats through
// /v1/chat/completions with stream: true. No framework, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "pippin-api-key";
let apiKey = localStorage.getItem(KEY_STORE) || "";
let prev = null; // the previous scrape: {t, samples}
const history = []; // output tokens/s over time, for the sparkline
const conversation = [];
let controller = null;

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

async function api(path, init) {
  const r = await fetch(path, Object.assign({}, init, { headers: headers((init || {}).headers) }));
  if (r.status === 401) {
    askForKey(apiKey ? "That key was refused." : "");
    throw new Error("unauthorized");
  }
  return r;
}

// --- API key ------------------------------------------------------------------------
function askForKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  apiKey = $("key-input").value.trim();
  localStorage.setItem(KEY_STORE, apiKey);
  $("key-form").hidden = true;
  $("key-change").hidden = false;
  refreshModels();
  poll();
});
$("key-change").addEventListener("click", () => askForKey(""));

// --- Prometheus text ----------------------------------------------------------------
// Returns a map "name{labels}" -> value, labels in the order the server wrote them.
function parseProm(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const i = line.lastIndexOf(" ");
    out.set(line.slice(0, i), parseFloat(line.slice(i + 1)));
  }
  return out;
}

// Sum of every sample of `name` whose labels contain all of `match` (e.g. 'state="used"').
function sum(samples, name, ...match) {
  let total = 0, seen = false;
  for (const [key, v] of samples) {
    const brace = key.indexOf("{");
    const base = brace < 0 ? key : key.slice(0, brace);
    if (base !== name) continue;
    if (match.every((m) => key.includes(m))) { total += v; seen = true; }
  }
  return seen ? total : null;
}

function rate(now, name, dt) {
  if (!prev) return null;
  const a = sum(prev.samples, name), b = sum(now, name);
  return a === null || b === null ? null : Math.max(0, b - a) / dt;
}

// Mean of a histogram over the last interval, or since start when nothing happened in it.
function histMean(now, name) {
  const s = sum(now, name + "_sum"), c = sum(now, name + "_count");
  if (s === null || !c) return null;
  if (prev) {
    const ds = s - sum(prev.samples, name + "_sum"), dc = c - sum(prev.samples, name + "_count");
    if (dc > 0) return ds / dc;
  }
  return s / c;
}

function fmtSeconds(x) {
  if (x === null || x === undefined || isNaN(x)) return "–";
  return x < 1 ? (x * 1000).toFixed(1) + " ms" : x.toFixed(2) + " s";
}
function fmtNum(x, digits) {
  if (x === null || x === undefined || isNaN(x)) return "–";
  return x.toLocaleString(undefined, { maximumFractionDigits: digits || 0 });
}

// --- live numbers -------------------------------------------------------------------
async function poll() {
  try {
    const h = await fetch("/health");
    $("health").textContent = h.ok ? "ready" : "loading";
    $("health").className = "pill " + (h.ok ? "ok" : "bad");
  } catch (e) {
    $("health").textContent = "offline";
    $("health").className = "pill bad";
    return;
  }
  let r;
  try { r = await api("/metrics"); } catch (e) { return; }
  if (r.status === 404) { $("metrics-off").hidden = false; return; }
  const t = performance.now() / 1000;
  const now = parseProm(await r.text());
  const dt = prev ? t - prev.t : 1;
  const tokRate = rate(now, "pippin_generation_tokens_total", dt);
  const reqRate = rate(now, "pippin_requests_finished_total", dt);
  $("tok-rate").textContent = fmtNum(tokRate, 1);
  $("req-rate").textContent = fmtNum(reqRate, 2);
  $("running").textContent = fmtNum(sum(now, "pippin_requests_running"));
  $("waiting").textContent = fmtNum(sum(now, "pippin_requests_waiting"));
  $("ttft").textContent = fmtSeconds(histMean(now, "pippin_time_to_first_token_seconds"));
  $("itl").textContent = fmtSeconds(histMean(now, "pippin_inter_token_latency_seconds"));
  $("e2e").textContent = fmtSeconds(histMean(now, "pippin_e2e_request_latency_seconds"));
  $("queue").textContent = fmtSeconds(histMean(now, "pippin_request_queue_time_seconds"));
  const hit = sum(now, "pippin_prefix_cache_hit_ratio");
  $("prefix").textContent = hit === null ? "–" : (hit * 100).toFixed(0) + "%";
  $("preempt").textContent = fmtNum(sum(now, "pippin_preemptions_total"));
  $("gen-total").textContent = fmtNum(sum(now, "pippin_generation_tokens_total"));
  $("errors").textContent = fmtNum(sum(now, "pippin_request_errors_total") || 0);
  const used = sum(now, "pippin_kv_blocks", 'state="used"');
  const free = sum(now, "pippin_kv_blocks", 'state="free"');
  if (used !== null && free !== null) {
    const pct = used + free ? (100 * used) / (used + free) : 0;
    $("kv-fill").style.width = pct.toFixed(1) + "%";
    $("kv-used").textContent = `${fmtNum(used)} / ${fmtNum(used + free)} blocks (${pct.toFixed(1)}%)`;
  }
  if (prev && tokRate !== null) { history.push(tokRate); if (history.length > 120) history.shift(); }
  drawSpark();
  prev = { t, samples: now };
  $("stats").dataset.scrapes = String(Number($("stats").dataset.scrapes || 0) + 1);
}

function drawSpark() {
  const c = $("spark"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  if (history.length < 2) return;
  const max = Math.max(1, ...history);
  g.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue("--accent");
  g.lineWidth = 2;
  g.beginPath();
  history.forEach((v, i) => {
    const x = (i / (history.length - 1)) * c.width;
    const y = c.height - 4 - (v / max) * (c.height - 8);
    if (i) g.lineTo(x, y); else g.moveTo(x, y);
  });
  g.stroke();
  g.fillStyle = g.strokeStyle;
  g.fillText(`${max.toFixed(0)} tok/s`, 4, 12);
}

// The chat models' sampling defaults (/v1/models), shown in the empty temperature field.
const modelDefaults = new Map();

function showDefaults() {
  const d = modelDefaults.get($("chat-model").value);
  const t = d && d.temperature;
  $("chat-temp").placeholder = t === undefined ? "model's" : `model's: ${t}`;
}

async function refreshModels() {
  try {
    const v = await (await fetch("/version")).json();
    $("version").textContent = "v" + v.version;
  } catch (e) { /* old server */ }
  let r;
  try { r = await api("/v1/models"); } catch (e) { return; }
  if (!r.ok) return;
  const data = (await r.json()).data || [];
  const list = $("models"), select = $("chat-model"), chosen = select.value;
  list.replaceChildren();
  select.replaceChildren();
  sttModel = null;
  visionModels.clear();
  modelDefaults.clear();
  for (const m of data) {
    if ((m.capabilities || []).includes("vision")) visionModels.add(m.id);
    if (m.sampling_defaults) modelDefaults.set(m.id, m.sampling_defaults);
    const li = document.createElement("li");
    li.textContent = m.id + (m.max_model_len ? ` — context ${m.max_model_len} tokens` : "")
      + (m.kind ? ` (${m.kind})` : "");
    list.appendChild(li);
    if (m.kind === "speech-to-text") sttModel = sttModel || m.id;
    if (m.kind) continue; // not a chat model
    const o = document.createElement("option");
    o.value = o.textContent = m.id;
    select.appendChild(o);
  }
  if (chosen) select.value = chosen;
  showAttach();
  showDefaults();
  showSpeech(data.filter((m) => "voices" in m));
  $("transcribe").hidden = !sttModel;
}

// --- speech (/v1/audio/speech) -------------------------------------------------------
let speechModels = [];

function showSpeech(models) {
  speechModels = models;
  $("speech").hidden = models.length === 0;
  const select = $("speech-model"), chosen = select.value;
  select.replaceChildren();
  for (const m of models) {
    const o = document.createElement("option");
    o.value = o.textContent = m.id;
    select.appendChild(o);
  }
  if (chosen && models.some((m) => m.id === chosen)) select.value = chosen;
  showVoices();
}

function showVoices() {
  const m = speechModels.find((x) => x.id === $("speech-model").value);
  const select = $("speech-voice"), chosen = select.value;
  select.replaceChildren();
  for (const v of (m && m.voices) || []) {
    const o = document.createElement("option");
    o.value = o.textContent = v;
    select.appendChild(o);
  }
  if (chosen && m && (m.voices || []).includes(chosen)) select.value = chosen;
}

async function speak(text) {
  const meta = $("speech-meta");
  meta.classList.remove("error");
  meta.textContent = "…";
  $("speech-send").disabled = true;
  const t0 = performance.now();
  try {
    const r = await api("/v1/audio/speech", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model: $("speech-model").value,
        voice: $("speech-voice").value,
        input: text,
        speed: Number($("speech-speed").value) || 1,
        response_format: "mp3",
      }),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
    }
    const blob = await r.blob();
    const audio = $("speech-audio");
    if (audio.src) URL.revokeObjectURL(audio.src);
    audio.src = URL.createObjectURL(blob);
    audio.hidden = false;
    audio.play().catch(() => { /* autoplay refused: the controls are there */ });
    const secs = (performance.now() - t0) / 1000;
    meta.textContent = `${(blob.size / 1024).toFixed(1)} KiB mp3 · ${secs.toFixed(2)} s`;
  } catch (e) {
    meta.textContent = "error: " + e.message;
    meta.classList.add("error");
  } finally {
    $("speech-send").disabled = false;
  }
}

$("speech-model").addEventListener("change", showVoices);
$("speech-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("speech-input").value.trim();
  if (text) speak(text);
});

// --- chat ---------------------------------------------------------------------------
const visionModels = new Set(); // chat models whose /v1/models card lists "vision"
let attached = []; // data: URLs of the images for the next message

// Only a vision model takes images: others hide the button (and drop what was attached).
function showAttach() {
  const vision = visionModels.has($("chat-model").value);
  $("chat-attach").hidden = !vision;
  if (!vision) setAttached([]);
}

function thumb(url) {
  const img = document.createElement("img");
  img.className = "thumb";
  img.src = url;
  img.alt = "attached image";
  return img;
}

function setAttached(urls) {
  attached = urls;
  const box = $("chat-attached");
  box.replaceChildren(...urls.map(thumb));
  if (urls.length) {
    const clear = document.createElement("button");
    clear.type = "button";
    clear.className = "link";
    clear.textContent = "remove";
    clear.addEventListener("click", () => setAttached([]));
    box.appendChild(clear);
  }
  box.hidden = urls.length === 0;
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attach(files) {
  const images = [...files].filter((f) => f.type.startsWith("image/"));
  if (!images.length || !visionModels.has($("chat-model").value)) return false;
  setAttached([...attached, ...(await Promise.all(images.map(readAsDataURL)))]);
  return true;
}

$("chat-model").addEventListener("change", showAttach);
$("chat-model").addEventListener("change", showDefaults);
$("chat-attach").addEventListener("click", () => $("chat-file").click());
$("chat-file").addEventListener("change", async () => {
  await attach($("chat-file").files);
  $("chat-file").value = "";
});
$("chat-input").addEventListener("paste", (e) => {
  const files = [...(e.clipboardData || {}).files || []];
  if (files.some((f) => f.type.startsWith("image/")) && visionModels.has($("chat-model").value)) {
    e.preventDefault();
    attach(files);
  }
});

function addMessage(role, text, images) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "you" : "model";
  const reasoning = document.createElement("span");
  reasoning.className = "reasoning";
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text || "";
  const meta = document.createElement("span");
  meta.className = "meta";
  div.append(who, reasoning);
  if (images && images.length) {
    const pictures = document.createElement("span");
    pictures.className = "pictures";
    pictures.append(...images.map(thumb));
    div.append(pictures);
  }
  div.append(body, meta);
  $("chat-log").appendChild(div);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return { div, reasoning, body, meta };
}

// Yields the JSON payloads of an SSE response body.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  // Images go first, as OpenAI image_url parts holding data: URLs.
  const images = attached;
  setAttached([]);
  const content = images.length
    ? [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }]
    : text;
  conversation.push({ role: "user", content });
  addMessage("user", text, images);
  const out = addMessage("assistant", "");
  out.div.classList.add("streaming");
  $("chat-send").hidden = true;
  $("chat-stop").hidden = false;
  controller = new AbortController();
  const t0 = performance.now();
  let first = null, tokens = 0, answer = "";
  try {
    const body = {
      model: $("chat-model").value,
      messages: conversation,
      stream: true,
      stream_options: { include_usage: true },
      max_tokens: Number($("chat-max").value) || 256,
    };
    // Left empty, the field sends nothing: the server samples with the model's defaults.
    const temp = $("chat-temp").value.trim();
    if (temp !== "") body.temperature = Number(temp);
    const r = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      signal: controller.signal,
      body: JSON.stringify(body),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
    }
    for await (const chunk of sseEvents(r)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
      const thought = delta.reasoning_content || delta.reasoning || "";
      if ((delta.content || thought) && first === null) first = performance.now();
      if (thought) out.reasoning.textContent += thought;
      if (delta.content) { answer += delta.content; out.body.textContent = answer; }
      $("chat-log").scrollTop = $("chat-log").scrollHeight;
    }
    conversation.push({ role: "assistant", content: answer });
    const total = (performance.now() - t0) / 1000;
    const ttft = first === null ? null : (first - t0) / 1000;
    out.meta.textContent = `${tokens} tokens · first token ${fmtSeconds(ttft)} · ${total.toFixed(2)} s`;
  } catch (e) {
    conversation.pop();
    out.meta.textContent = e.name === "AbortError" ? "stopped" : "error: " + e.message;
    out.meta.classList.add("error");
  } finally {
    out.div.classList.remove("streaming");
    out.div.classList.add("done");
    $("chat-send").hidden = false;
    $("chat-stop").hidden = true;
    controller = null;
  }
}

$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || controller) return;
  $("chat-input").value = "";
  send(text);
});
$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
});
$("chat-stop").addEventListener("click", () => controller && controller.abort());
$("chat-clear").addEventListener("click", () => { conversation.length = 0; $("chat-log").replaceChildren(); });

// --- speech to text: an uploaded file or a recording, to /v1/audio/transcriptions -----
let sttModel = null;
let recorder = null;

function sttStatus(text, isError) {
  $("stt-status").textContent = text;
  $("stt-status").classList.toggle("error", !!isError);
}

async function transcribe(blob, name) {
  const form = new FormData();
  form.append("file", blob, name);
  form.append("model", sttModel);
  sttStatus("transcribing…");
  $("stt-text").textContent = "";
  $("stt-send").disabled = true;
  try {
    const r = await api("/v1/audio/transcriptions", { method: "POST", body: form });
    const body = await r.json();
    if (!r.ok) throw new Error((body.error || {}).message || r.statusText);
    $("stt-text").textContent = body.text;
    sttStatus(body.usage ? `${body.usage.seconds} s of audio` : "");
  } catch (e) {
    sttStatus("error: " + e.message, true);
  } finally {
    $("stt-send").disabled = false;
  }
}

$("stt-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const file = $("stt-file").files[0];
  if (!file) { sttStatus("Choose an audio file, or record one.", true); return; }
  transcribe(file, file.name);
});

$("stt-record").addEventListener("click", async () => {
  if (recorder) { recorder.stop(); return; }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (e) {
    sttStatus("no microphone: " + e.message, true);
    return;
  }
  const chunks = [];
  recorder = new MediaRecorder(stream);
  recorder.ondataavailable = (ev) => chunks.push(ev.data);
  recorder.onstop = () => {
    stream.getTracks().forEach((t) => t.stop());
    const type = recorder.mimeType || "audio/webm";
    recorder = null;
    $("stt-record").textContent = "Record";
    transcribe(new Blob(chunks, { type }), type.includes("ogg") ? "recording.ogg" : "recording.webm");
  };
  recorder.start();
  $("stt-record").textContent = "Stop";
  sttStatus("recording…");
});

if (apiKey) $("key-change").hidden = false;
refreshModels();
poll();
setInterval(poll, 1000);
setInterval(refreshModels, 15000);
