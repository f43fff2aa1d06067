// Chat: a multi-turn conversation with one model id. Switching the model
// (the field, or "/model ID" as in `mola chat`) keeps the conversation: the
// next answer comes from the new model, given every turn so far. An image
// attached (image.js) goes with the next message, and stays in the
// conversation as that message's part.

import { modelFields, streamAnswer } from "./api.js";
import { ImagePicker } from "./image.js";

const $ = (selector) => document.querySelector(selector);

export class Chat {
  constructor(api, models) {
    this.api = api;
    this.models = models;
    this.messages = []; // the conversation: {role, content}, without the system message
    this.controller = null;
    this.model = $("#chat-model");
    this.input = $("#chat-input");
    this.error = $("#chat-error");
    this.image = new ImagePicker(models, "chat");
    $("#chat-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    $("#chat-reset").addEventListener("click", () => this.reset());
  }

  start() {
    this.image.refresh();
    if (!this.model.value) this.model.value = this.models.baseId;
  }

  reset() {
    if (this.controller) this.controller.abort();
    this.controller = null;
    this.messages = [];
    $("#chat-log").replaceChildren();
    this.showError("");
  }

  showError(message) {
    this.error.textContent = message;
    this.error.hidden = !message;
  }

  append(who, text, role, image = null) {
    const item = document.createElement("li");
    item.className = role;
    const label = document.createElement("span");
    label.className = "who";
    label.textContent = who;
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    item.append(label, body);
    if (image) {
      const shown = document.createElement("img");
      shown.src = image;
      shown.alt = "The image sent with this message";
      item.append(shown);
    }
    $("#chat-log").append(item);
    return body;
  }

  async send() {
    const text = this.input.value.trim();
    if (!text || this.controller) return;
    this.input.value = "";
    this.showError("");
    const switched = text.match(/^\/model\s+(\S+)$/);
    if (switched) {
      this.model.value = switched[1];
      this.append("mola", `now answering with ${switched[1]}; the conversation stays`, "note");
      return;
    }
    const image = this.image.dataUrl;
    this.messages.push({ role: "user", content: this.image.content(text) });
    const asked = this.append("you", text, "user", image);
    const model = this.model.value.trim() || this.models.baseId;
    const system = $("#chat-system").value.trim();
    const body = {
      ...modelFields(model, null, this.models),
      messages: [...(system ? [{ role: "system", content: system }] : []), ...this.messages],
      temperature: Number($("#chat-temperature").value),
      max_tokens: Number($("#chat-max-tokens").value),
    };
    const answer = this.append(model, "", "assistant");
    const controller = (this.controller = new AbortController());
    try {
      const result = await streamAnswer(this.api, body, controller.signal, (t) => { answer.textContent = t; });
      this.messages.push({ role: "assistant", content: result.text });
      if (image && this.image.dataUrl === image) this.image.clear(); // it went with this message
      $("#chat-status").textContent = `${model}: ${result.text}`; // read out once, whole
    } catch (error) {
      if (error.name === "AbortError") return; // a new conversation began
      this.messages.pop(); // the turn did not happen: its text goes back to the input
      asked.parentElement.remove();
      answer.parentElement.remove();
      this.input.value = text;
      this.showError(error.message);
    } finally {
      if (this.controller === controller) this.controller = null;
    }
  }
}
