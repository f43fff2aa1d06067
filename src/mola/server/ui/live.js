// Live: polls /metrics (Prometheus text) and draws each series as an SVG
// sparkline of its last minute (a poll every half second): running and waiting rows, slots used,
// tokens/s (decoded rows and accepted draft tokens, per second between two
// polls) and the prompt cache's hit rate since the server started.

const SVG = "http://www.w3.org/2000/svg";
const POINTS = 120; // a minute of polls

const SERIES = [
  { id: "running", label: "Running rows", format: (v) => String(v) },
  { id: "waiting", label: "Waiting rows", format: (v) => String(v) },
  { id: "slots", label: "Slots used", format: (v, m) => `${v} of ${m.slots}` },
  { id: "tps", label: "Tokens/s", format: (v) => v.toFixed(0) },
  { id: "hits", label: "Prompt-cache hit rate", format: (v) => `${(100 * v).toFixed(0)}%` },
];

// {metric name: value summed over its label sets} from Prometheus text.
export function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([a-zA-Z_:][\w:]*)(\{.*\})?\s+(\S+)/);
    if (match) values[match[1]] = (values[match[1]] || 0) + Number(match[3]);
  }
  return values;
}

// One sample of every series; `previous` (the last poll's metrics and time) gives the rates.
export function sample(metrics, now, previous) {
  const get = (name) => metrics[name] || 0;
  const tokens = get("mola_decode_rows_total") + get("mola_speculative_accepted_tokens_total");
  const seconds = previous ? (now - previous.now) / 1000 : 0;
  const hits = get("mola_prompt_cache_hits_total");
  const lookups = hits + get("mola_prompt_cache_misses_total");
  return {
    running: get("mola_running_requests"),
    waiting: get("mola_waiting_requests"),
    slots: get("mola_adapters_resident"),
    tps: seconds > 0 ? Math.max(0, tokens - previous.tokens) / seconds : 0,
    hits: lookups ? hits / lookups : 0,
    tokens,
    maxSlots: get("mola_adapter_slots"),
  };
}

function chart(series) {
  const item = document.createElement("li");
  item.dataset.series = series.id;
  const label = document.createElement("span");
  label.className = "label";
  label.textContent = series.label;
  const value = document.createElement("span");
  value.className = "value";
  value.textContent = "–";
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${POINTS - 1} 20`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  const line = document.createElementNS(SVG, "polyline");
  svg.append(line);
  item.append(label, value, svg);
  return item;
}

export class Live {
  constructor(api, intervalMs = 500) {
    this.api = api;
    this.intervalMs = intervalMs;
    this.previous = null;
    this.history = Object.fromEntries(SERIES.map((s) => [s.id, []]));
    this.items = Object.fromEntries(SERIES.map((s) => [s.id, chart(s)]));
    document.querySelector("#live-charts").append(...Object.values(this.items));
  }

  start() {
    const tick = async () => {
      if (!document.hidden) await this.poll();
      setTimeout(tick, this.intervalMs);
    };
    tick();
  }

  async poll() {
    const error = document.querySelector("#live-error");
    let metrics;
    try {
      metrics = parseMetrics(await this.api.metricsText());
    } catch (e) {
      error.textContent = `Metrics: ${e.message}`;
      error.hidden = false;
      return;
    }
    error.hidden = true;
    const now = performance.now();
    const values = sample(metrics, now, this.previous);
    this.previous = { now, tokens: values.tokens };
    for (const series of SERIES) this.draw(series, values);
  }

  draw(series, values) {
    const points = this.history[series.id];
    points.push(values[series.id]);
    if (points.length > POINTS) points.shift();
    const top = series.id === "hits" ? 1 : series.id === "slots" ? values.maxSlots || 1 : Math.max(1, ...points);
    const offset = POINTS - points.length;
    const item = this.items[series.id];
    const text = series.format(values[series.id], { slots: values.maxSlots });
    item.dataset.value = String(values[series.id]);
    item.querySelector(".value").textContent = text;
    item.querySelector("polyline").setAttribute("points",
      points.map((v, i) => `${offset + i},${(20 - (19 * v) / top).toFixed(2)}`).join(" "));
    item.querySelector("svg").setAttribute("aria-label", `${series.label} over the last ${POINTS} polls, now ${text}`);
  }
}
