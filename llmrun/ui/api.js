// The daemon's Ollama API, as the page uses it. Same-origin fetches: they pass the daemon's
// Host and Origin checks as they are; the key (when the daemon has LLMRUN_API_KEYS) is sent
// as a bearer token and kept in sessionStorage only, so it dies with the tab.

const KEY = "llmrun.key";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export const key = {
  get: () => sessionStorage.getItem(KEY) || "",
  set: (value) => sessionStorage.setItem(KEY, value),
};

async function errorMessage(response) {
  try {
    const body = await response.json();
    const error = body.error;
    return typeof error === "string" ? error : (error && error.message) || response.statusText;
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function request(path, { method = "GET", body, signal } = {}) {
  const headers = {};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const secret = key.get();
  if (secret) headers.Authorization = `Bearer ${secret}`;
  const response = await fetch(path, {
    method, headers, signal, cache: "no-store",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) throw new ApiError(response.status, await errorMessage(response));
  return response;
}

async function json(path, options) {
  return (await request(path, options)).json();
}

// Newline-delimited JSON objects as they arrive; an object with `error` (a failure after the
// stream began) is thrown. Aborting `signal` closes the connection, which the daemon turns
// into a cancel of the request.
async function* ndjson(path, body, signal) {
  const response = await request(path, { method: "POST", body, signal });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  const parse = (line) => {
    const event = JSON.parse(line);
    if (event.error) throw new ApiError(0, event.error);
    return event;
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 1);
      if (line) yield parse(line);
    }
  }
  if (buffer.trim()) yield parse(buffer.trim());
}

export const api = {
  tags: () => json("/api/tags"),
  ps: () => json("/api/ps"),
  show: (model) => json("/api/show", { method: "POST", body: { model } }),
  unload: (model) => json("/api/generate", { method: "POST", body: { model, keep_alive: 0 } }),
  pull: (model, signal) => ndjson("/api/pull", { model, stream: true }, signal),
  chat: (body, signal) => ndjson("/api/chat", { ...body, stream: true }, signal),
};
