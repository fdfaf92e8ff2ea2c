// Conversations, kept in the browser (IndexedDB), one record each:
//   {id, title, model, settings: {system, temperature, top_p, num_ctx, num_predict, seed},
//    messages: [{role, content, model?, thinking?, images?: [base64], stats?, stopped?, cut?,
//                error?}],
//    created, updated}
// Export and import carry the same records as JSON.

const DB = "llmrun";
const STORE = "conversations";
const FORMAT = "llmrun-conversations";

let opened = null;

function db() {
  opened ??= new Promise((resolve, reject) => {
    const open = indexedDB.open(DB, 1);
    open.onupgradeneeded = () => open.result.createObjectStore(STORE, { keyPath: "id" });
    open.onsuccess = () => resolve(open.result);
    open.onerror = () => reject(open.error);
  });
  return opened;
}

async function run(mode, work) {
  const tx = (await db()).transaction(STORE, mode);
  const result = work(tx.objectStore(STORE));
  return new Promise((resolve, reject) => {
    tx.oncomplete = () => resolve(result.result);
    tx.onerror = () => reject(tx.error);
    tx.onabort = () => reject(tx.error);
  });
}

export function newId() {
  if (crypto.randomUUID) return crypto.randomUUID();  // secure contexts (loopback is one)
  return Array.from(crypto.getRandomValues(new Uint8Array(16)),
    (b) => b.toString(16).padStart(2, "0")).join("");
}

export const conversations = {
  async all() {
    const list = await run("readonly", (s) => s.getAll());
    return list.sort((a, b) => b.updated - a.updated);
  },
  get: (id) => run("readonly", (s) => s.get(id)),
  put: (conversation) => run("readwrite", (s) => s.put(conversation)),
  remove: (id) => run("readwrite", (s) => s.delete(id)),
};

export function exportJSON(list) {
  return JSON.stringify({ format: FORMAT, version: 1, conversations: list }, null, 2);
}

const ROLES = new Set(["system", "user", "assistant"]);
const NUMBERS = ["temperature", "top_p", "num_ctx", "num_predict", "seed"];

function str(value, limit = 10_000_000) {
  return typeof value === "string" ? value.slice(0, limit) : "";
}

// Only the known fields, each of its type: an imported file is as untrusted as model output.
function cleanMessage(m) {
  if (!m || !ROLES.has(m.role)) return null;
  const out = { role: m.role, content: str(m.content) };
  if (m.model) out.model = str(m.model, 300);
  if (m.thinking) out.thinking = str(m.thinking);
  if (Array.isArray(m.images)) {
    out.images = m.images.filter((i) => typeof i === "string" && /^[A-Za-z0-9+/=]+$/.test(i));
  }
  if (m.stopped === true) out.stopped = true;
  if (m.cut === true) out.cut = true;
  if (m.error) out.error = str(m.error, 2000);
  if (m.stats && typeof m.stats === "object") {
    out.stats = {};
    for (const k of ["tokens_per_s", "context_used", "context_size"]) {
      if (Number.isFinite(m.stats[k])) out.stats[k] = m.stats[k];
    }
  }
  return out;
}

function cleanConversation(c) {
  if (!c || typeof c.id !== "string" || !Array.isArray(c.messages)) return null;
  const settings = { system: str(c.settings?.system) };
  for (const k of NUMBERS) {
    if (Number.isFinite(c.settings?.[k])) settings[k] = c.settings[k];
  }
  const now = Date.now();
  return {
    id: c.id.slice(0, 100), title: str(c.title, 200) || "Imported chat", model: str(c.model, 300),
    settings, messages: c.messages.map(cleanMessage).filter(Boolean),
    created: Number.isFinite(c.created) ? c.created : now,
    updated: Number.isFinite(c.updated) ? c.updated : now,
  };
}

// The conversations of an exported file, cleaned; throws with a message for a wrong file.
export function parseImport(text) {
  let data;
  try {
    data = JSON.parse(text);
  } catch {
    throw new Error("this file is not JSON");
  }
  if (data?.format !== FORMAT || !Array.isArray(data.conversations)) {
    throw new Error("this file is not an llmrun conversation export");
  }
  return data.conversations.map(cleanConversation).filter(Boolean);
}
