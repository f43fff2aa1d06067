// Compare: one prompt sent at once to 2-4 columns, each with its own model id,
// lora_scale, temperature and max tokens. The requests go out together, so
// the server decodes them in one mixed batch.

import { modelFields, streamAnswer } from "./api.js";
import { ImagePicker } from "./image.js";

const SWEEP_SCALES = [0, 0.5, 1, 1.5];
const MIN_COLUMNS = 2;
const MAX_COLUMNS = 4;

const $ = (selector) => document.querySelector(selector);

function showError(element, message) {
  element.textContent = message || "";
  element.hidden = !message;
}

class Column {
  constructor(compare, element) {
    this.compare = compare;
    this.element = element;
    this.controller = null;
    this.find = (selector) => element.querySelector(selector);
    this.model = this.find(".model");
    this.scale = this.find(".scale");
    this.model.addEventListener("input", () => this.syncScale());
    this.scale.addEventListener("input", () => { this.find(".scale-value").value = this.scale.value; });
    this.scale.addEventListener("change", () => compare.runColumns([this])); // re-ask at this scale
    this.find(".sweep").addEventListener("click", () => compare.sweep(this));
    this.find(".remove").addEventListener("click", () => compare.removeColumn(this));
  }

  number(index) {
    const title = `Column ${index + 1}`;
    const heading = this.find(".column-title");
    heading.textContent = title;
    heading.id = `column-${index + 1}-title`;
    this.element.setAttribute("aria-labelledby", heading.id);
    this.find(".sweep").setAttribute("aria-label", `Sweep column ${index + 1}'s model over scales 0 to 1.5`);
    this.find(".remove").setAttribute("aria-label", `Remove column ${index + 1}`);
  }

  set(model, scale) {
    this.model.value = model;
    this.scale.value = String(scale);
    this.find(".scale-value").value = this.scale.value;
    this.syncScale();
  }

  // A base model takes no lora_scale.
  syncScale() {
    this.scale.disabled = this.compare.models.isBase(this.model.value.trim());
  }

  body(common) {
    const scale = this.scale.disabled ? null : Number(this.scale.value);
    return {
      ...common,
      ...modelFields(this.model.value, scale, this.compare.models),
      temperature: Number(this.find(".temperature").value),
      max_tokens: Number(this.find(".max-tokens").value),
    };
  }

  async run(common, schema) {
    if (this.controller) this.controller.abort();
    const controller = (this.controller = new AbortController());
    const answer = this.find(".answer");
    this.stats("–", "–", "–", "");
    answer.textContent = "";
    answer.classList.remove("error");
    this.element.setAttribute("aria-busy", "true");
    try {
      const result = await streamAnswer(this.compare.api, this.body(common), controller.signal,
        (text) => { answer.textContent = text; });
      const fmt = (value, digits) => (value === null ? "–" : value.toFixed(digits));
      this.stats(fmt(result.ttftMs, 0), fmt(result.tokensPerSecond, 1), result.cachedTokens,
        schema ? jsonVerdict(result.text) : "");
    } catch (error) {
      if (error.name === "AbortError") return;
      answer.textContent = error.message;
      answer.classList.add("error");
    } finally {
      if (this.controller === controller) {
        this.controller = null;
        this.element.setAttribute("aria-busy", "false");
      }
    }
  }

  stats(ttft, tps, cached, json) {
    this.find(".ttft").textContent = `TTFT ${ttft} ms`;
    this.find(".tps").textContent = `${tps} tok/s`;
    this.find(".cached").textContent = `cached ${cached}`;
    this.find(".json").textContent = json;
  }
}

function jsonVerdict(text) {
  try {
    JSON.parse(text);
    return "· valid JSON";
  } catch {
    return "· not JSON";
  }
}

export class Compare {
  constructor(api, models) {
    this.api = api;
    this.models = models;
    this.columns = [];
    this.image = new ImagePicker(models, "compare");
    this.error = $("#compare-error");
    $("#compare-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.runColumns(this.columns);
    });
    $("#add-column").addEventListener("click", () => this.addColumn(this.models.baseId || "", 1));
  }

  // The first columns: the base, then the first adapters.
  start() {
    this.image.refresh();
    if (this.columns.length) return this.columns.forEach((column) => column.syncScale());
    const ids = [this.models.baseId, ...this.models.adapterIds];
    for (let i = 0; i < Math.min(3, Math.max(MIN_COLUMNS, ids.length)); i++) this.addColumn(ids[i] || ids[0], 1);
  }

  addColumn(model, scale) {
    if (this.columns.length >= MAX_COLUMNS) return null;
    const element = $("#column-template").content.firstElementChild.cloneNode(true);
    const column = new Column(this, element);
    $("#columns").append(element);
    this.columns.push(column);
    column.set(model, scale);
    this.renumber();
    return column;
  }

  removeColumn(column) {
    if (this.columns.length <= MIN_COLUMNS) return;
    if (column.controller) column.controller.abort();
    column.element.remove();
    this.columns = this.columns.filter((c) => c !== column);
    this.renumber();
  }

  renumber() {
    this.columns.forEach((column, i) => {
      column.number(i);
      column.find(".remove").disabled = this.columns.length <= MIN_COLUMNS;
    });
    $("#add-column").disabled = this.columns.length >= MAX_COLUMNS;
  }

  // One column per scale of SWEEP_SCALES, all with this column's model.
  sweep(column) {
    const model = column.model.value;
    while (this.columns.length < SWEEP_SCALES.length) this.addColumn(model, 1);
    while (this.columns.length > SWEEP_SCALES.length) this.removeColumn(this.columns[this.columns.length - 1]);
    this.columns.forEach((c, i) => c.set(model, SWEEP_SCALES[i]));
    this.runColumns(this.columns);
  }

  // What every column sends alike: the messages (the image too, when one is attached), the seed,
  // the response format.
  common() {
    const system = $("#compare-system").value.trim();
    const user = $("#compare-user").value;
    if (!user.trim()) throw new Error("Write a user message first.");
    const common = { messages: [...(system ? [{ role: "system", content: system }] : []), { role: "user", content: this.image.content(user) }] };
    if ($("#same-seed").checked) common.seed = Number($("#seed").value);
    const schema = $("#schema").value.trim();
    if (schema) {
      let parsed;
      try {
        parsed = JSON.parse(schema);
      } catch (error) {
        throw new Error(`The JSON schema is not valid JSON: ${error.message}`);
      }
      common.response_format = { type: "json_schema", json_schema: { name: "playground", schema: parsed, strict: true } };
    }
    return common;
  }

  runColumns(columns) {
    let common;
    try {
      common = this.common();
    } catch (error) {
      return showError(this.error, error.message);
    }
    showError(this.error, "");
    return Promise.all(columns.map((column) => column.run(common, Boolean(common.response_format))));
  }
}
