// An image for a message (docs/vision.md): picked from a file or pasted,
// shown while it is attached, and sent inline as an OpenAI `image_url` part
// with a data: URL (by every column of the comparison; with the next chat
// message). The field shows only when a base the server serves takes images
// (its /v1/models card lists "image" in input_modalities). One picker a view:
// its elements are `#{view}-image-field`, `-image`, `-image-preview`,
// `-image-status` and `-image-remove`, and it takes pastes into `#{view}-form`.

const $ = (selector) => document.querySelector(selector);
const TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

export class ImagePicker {
  constructor(models, view) {
    this.models = models;
    this.dataUrl = null;
    this.field = $(`#${view}-image-field`);
    this.input = $(`#${view}-image`);
    this.preview = $(`#${view}-image-preview`);
    this.status = $(`#${view}-image-status`);
    this.remove = $(`#${view}-image-remove`);
    this.input.addEventListener("change", () => this.take(this.input.files[0]));
    this.remove.addEventListener("click", () => this.clear());
    // A pasted image (a screenshot, an image copied in another page) while the view's form has focus.
    $(`#${view}-form`).addEventListener("paste", (event) => {
      const item = [...(event.clipboardData?.items || [])].find((i) => i.kind === "file" && TYPES.includes(i.type));
      if (!item || this.field.hidden) return;
      event.preventDefault();
      this.take(item.getAsFile());
    });
  }

  // Shown when some base takes images; hidden (and emptied) otherwise.
  refresh() {
    this.field.hidden = !this.models.takesImagesAnywhere();
    if (this.field.hidden) this.clear();
  }

  async take(file) {
    if (!file) return this.clear();
    if (!TYPES.includes(file.type)) {
      this.clear();
      this.status.textContent = `${file.name || "That file"} is not a PNG, JPEG, WebP or GIF image.`;
      return;
    }
    this.dataUrl = await readAsDataUrl(file);
    this.preview.src = this.dataUrl;
    this.preview.alt = `The attached image: ${file.name || "pasted"}`;
    this.preview.hidden = false;
    this.remove.hidden = false;
    this.status.textContent = `Attached ${file.name || "a pasted image"} (${file.type}, ${file.size} bytes).`;
  }

  clear() {
    this.dataUrl = null;
    this.input.value = "";
    this.preview.removeAttribute("src");
    this.preview.alt = "";
    this.preview.hidden = true;
    this.remove.hidden = true;
    this.status.textContent = "";
  }

  // The user message's content: the text alone, or the text and the image.
  content(text) {
    if (!this.dataUrl) return text;
    return [{ type: "text", text }, { type: "image_url", image_url: { url: this.dataUrl } }];
  }
}
