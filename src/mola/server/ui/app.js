// The playground's start: the keys, the model ids, the views and the live panel.

import { Adapters } from "./adapters.js";
import { Api } from "./api.js";
import { Chat } from "./chat.js";
import { Compare } from "./compare.js";
import { Live } from "./live.js";

const $ = (selector) => document.querySelector(selector);

// The model ids the server serves (GET /v1/models): the default base, then
// the other ids (adapters, and further bases with their adapters).
class Models {
  constructor(api) {
    this.api = api;
    this.baseId = "";
    this.adapterIds = [];
    this.parents = new Map(); // model id -> its base's id (a base: itself)
    this.imageBases = new Set(); // the bases whose card lists "image" in input_modalities
  }

  async refresh() {
    const cards = (await this.api.json("GET", "/v1/models")).data;
    this.baseId = (cards.find((card) => card.parent === null) || cards[0]).id;
    this.adapterIds = cards.map((card) => card.id).filter((id) => id !== this.baseId);
    this.parents = new Map(cards.map((card) => [card.id, card.parent ?? card.id]));
    this.imageBases = new Set(cards.filter((card) => (card.input_modalities || []).includes("image"))
      .map((card) => card.parent ?? card.id));
    $("#model-ids").replaceChildren(...[this.baseId, ...this.adapterIds].map((id) => {
      const option = document.createElement("option");
      option.value = id;
      return option;
    }));
  }

  isBase(id) {
    return id === this.baseId || this.parents.get(id) === id;
  }

  // Whether some base the server serves takes images (the compare and chat views then offer an image field).
  takesImagesAnywhere() {
    return this.imageBases.size > 0;
  }

  // The base a model id (or a stack's first part) is served by.
  baseOf(id) {
    return this.parents.get(id) || this.baseId;
  }
}

function showView(name) {
  for (const button of document.querySelectorAll("nav [data-view]")) {
    const shown = button.dataset.view === name;
    button.setAttribute("aria-pressed", String(shown));
    $(`#${button.dataset.view}`).hidden = !shown;
  }
}

function main() {
  const api = new Api();
  const models = new Models(api);
  const compare = new Compare(api, models);
  const chat = new Chat(api, models);
  const adapters = new Adapters(api, () => models.refresh().catch(() => {}));

  // Read the model ids; a 401 means the server wants an API key: ask for it.
  const connect = async () => {
    try {
      await models.refresh();
    } catch (error) {
      const needed = $("#key-needed");
      needed.textContent = error.status === 401
        ? `This server needs an API key: enter it above. (${error.message})` : error.message;
      needed.hidden = false;
      $("#api-key").focus();
      return;
    }
    $("#key-needed").hidden = true;
    compare.start();
    chat.start();
    adapters.refresh();
  };

  const useKeys = () => {
    api.apiKey = $("#api-key").value.trim();
    api.adminKey = $("#admin-key").value.trim();
    connect();
  };
  $("#keys").addEventListener("submit", (event) => {
    event.preventDefault(); // never submitted: the keys must not reach the URL
    useKeys();
  });
  $("#api-key").addEventListener("change", useKeys);
  $("#admin-key").addEventListener("change", useKeys);
  for (const button of document.querySelectorAll("nav [data-view]")) {
    button.addEventListener("click", () => {
      showView(button.dataset.view);
      if (button.dataset.view === "adapters") adapters.refresh();
    });
  }
  new Live(api).start();
  connect();
}

main();
