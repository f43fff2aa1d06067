// The server's API over fetch: JSON calls, streamed chat completions (SSE)
// and the metrics text. The keys live on this object only: never in the URL,
// never in storage or cookies, gone when the page is closed.

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// The server's own message from an error body (OpenAI's envelope), else the status.
function messageOf(status, body) {
  const error = body && body.error;
  if (error && typeof error.message === "string") return error.message;
  if (body && typeof body.detail === "string") return body.detail;
  return `HTTP ${status}`;
}

async function failure(response) {
  const body = await response.json().catch(() => null);
  return new ApiError(response.status, messageOf(response.status, body));
}

export class Api {
  constructor() {
    this.apiKey = "";
    this.adminKey = "";
  }

  // Admin routes take the admin key when one is given (the server then wants it), else the API key.
  headers(admin = false) {
    const key = admin && this.adminKey ? this.adminKey : this.apiKey;
    const headers = { "Content-Type": "application/json" };
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }

  async json(method, path, body, { admin = false } = {}) {
    const response = await fetch(path, {
      method, headers: this.headers(admin), body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
    });
    if (!response.ok) throw await failure(response);
    return response.json();
  }

  async metricsText() {
    const response = await fetch("/metrics", { headers: this.headers(), cache: "no-store" });
    if (!response.ok) throw await failure(response);
    return response.text();
  }

  // Yields each parsed chunk of a streamed chat completion; an error before or
  // inside the stream is thrown as an ApiError with the server's message.
  async *chat(body, signal) {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: this.headers(), signal,
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    });
    if (!response.ok) throw await failure(response);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new ApiError(response.status, messageOf(response.status, chunk));
          yield chunk;
        }
      }
    }
  }
}

// One streamed answer: its text as it grows (onText), then time to first
// token, tokens/s and cached prompt tokens. Times come from performance.now().
export async function streamAnswer(api, body, signal, onText) {
  const start = performance.now();
  let text = "", first = null, usage = null;
  for await (const chunk of api.chat(body, signal)) {
    if (chunk.usage) usage = chunk.usage;
    const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
    if (delta && delta.content) {
      if (first === null) first = performance.now();
      text += delta.content;
      onText(text);
    }
  }
  const end = performance.now();
  const tokens = usage ? usage.completion_tokens : 0;
  const details = usage && usage.prompt_tokens_details;
  return {
    text,
    ttftMs: first === null ? null : first - start,
    // Decode speed: the tokens after the first, over the time after it.
    tokensPerSecond: first !== null && tokens > 1 && end > first ? (tokens - 1) / ((end - first) / 1000) : null,
    cachedTokens: details ? details.cached_tokens || 0 : 0,
    usage,
  };
}

// The request fields that pick a model: an id ("upper"), or a stack of
// adapters ("title*0.5+upper"), sent as their base plus `adapters`. `scale`
// (lora_scale, null: none) multiplies the adapter, or each part of a stack;
// a base model takes none. `models`: the ids' bases (app.js's Models).
export function modelFields(text, scale, models) {
  const parts = text.split("+").map((part) => part.trim()).filter(Boolean);
  if (parts.length > 1) {
    const k = scale === null ? 1 : scale;
    return {
      model: models.baseOf(parts[0].split("*")[0].trim()),
      adapters: parts.map((part) => {
        const [name, weight] = part.split("*");
        return { name: name.trim(), scale: (weight === undefined ? 1 : Number(weight)) * k };
      }),
    };
  }
  const model = parts[0] || models.baseId;
  return models.isBase(model) || scale === null ? { model } : { model, lora_scale: scale };
}
