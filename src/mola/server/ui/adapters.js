// Adapters: what GET /v1/adapters says of each one, and loading, unloading
// and reloading them (POST and DELETE /v1/adapters, with the admin key).
// A refusal shows the server's own message.

const $ = (selector) => document.querySelector(selector);

// Where an adapter is: in a slot, prepared in host memory, or only on disk.
export function stateOf(record) {
  if (record.state === "resident") return `resident (slot ${record.slot})`;
  if (record.state === "known") return record.cached ? "host tier" : "on disk";
  return record.state; // loading, yielding, draining
}

export function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) {
    n /= 1000;
    i++;
  }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

// The adapter's path under /v1/adapters/: each segment encoded, '/' kept (ids may be org/name).
const adapterUrl = (name) => `/v1/adapters/${name.split("/").map(encodeURIComponent).join("/")}`;

export class Adapters {
  constructor(api, onChange) {
    this.api = api;
    this.onChange = onChange; // the model ids changed: a load or an unload
    this.error = $("#adapters-error");
    $("#load-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const name = $("#load-name").value.trim();
      this.load(name, $("#load-path").value.trim() || name, Number($("#load-scale").value));
    });
    $("#adapters-refresh").addEventListener("click", () => this.refresh());
  }

  showError(message) {
    this.error.textContent = message;
    this.error.hidden = !message;
  }

  async refresh() {
    try {
      this.render(await this.api.json("GET", "/v1/adapters"));
    } catch (error) {
      this.showError(error.message);
    }
  }

  render(list) {
    const rows = [
      ...list.data.map((r) => this.row(r, true)),
      ...list.stacks.map((r) => this.row(r, false, "stack")),
      ...list.path_adapters.map((r) => this.row(r, false, "by path")),
    ];
    $("#adapter-rows").replaceChildren(...rows);
    const tier = list.host_tier || {};
    $("#adapters-summary").textContent = `${list.resident} of ${list.max_loras} slots in use, `
      + `${list.free_slots} free; host tier: ${tier.entries ?? 0} adapters.`;
  }

  row(record, manageable, kind = "") {
    const tr = document.createElement("tr");
    tr.dataset.name = record.name;
    const bytes = record.nbytes === null ? null : record.nbytes + (record.expert_nbytes || 0);
    const cells = [
      record.name + (kind ? ` (${kind})` : ""), stateOf(record), record.rank ?? "–",
      Array.isArray(record.targets) ? record.targets.join(", ") : "–",
      record.format ?? "–", record.version, formatBytes(bytes),
    ];
    for (const value of cells) {
      const td = document.createElement("td");
      td.textContent = String(value);
      tr.append(td);
    }
    const actions = document.createElement("td");
    if (manageable) {
      actions.append(
        this.button("Reload", `Reload ${record.name}`, () => this.reload(record)),
        this.button("Unload", `Unload ${record.name}`, () => this.unload(record.name)),
      );
    }
    tr.append(actions);
    return tr;
  }

  button(text, label, onClick) {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = text;
    button.setAttribute("aria-label", label);
    button.addEventListener("click", onClick);
    return button;
  }

  // Runs an admin call; then the list (and the model ids) are read again. True if it succeeded.
  async act(done, call) {
    this.showError("");
    $("#adapters-status").textContent = "";
    let ok = false;
    try {
      await call();
      $("#adapters-status").textContent = done;
      this.onChange();
      ok = true;
    } catch (error) {
      this.showError(error.message);
    }
    await this.refresh();
    return ok;
  }

  async load(name, path, scale) {
    const ok = await this.act(`Loaded ${name}.`,
      () => this.api.json("POST", "/v1/adapters", { name, path, scale }, { admin: true }));
    if (ok) $("#load-form").reset();
  }

  unload(name) {
    return this.act(`Unloaded ${name}.`, () => this.api.json("DELETE", adapterUrl(name), undefined, { admin: true }));
  }

  // Unload, then load from the same path: a new version.
  reload(record) {
    return this.act(`Reloaded ${record.name}.`, async () => {
      await this.api.json("DELETE", adapterUrl(record.name), undefined, { admin: true });
      await this.api.json("POST", "/v1/adapters",
        { name: record.name, path: record.path, scale: record.slot_scale }, { admin: true });
    });
  }
}
