// The page: asks for a key when the daemon wants one, lists conversations, wires the views.

import { ApiError, key } from "./api.js";
import { Chat } from "./chat.js";
import { $, button, element } from "./dom.js";
import { refresh, setUpPull, setUpStatus } from "./models.js";
import { setUpSettings } from "./settings.js";
import { conversations, exportJSON, newId, parseImport } from "./store.js";

let current = blank();

function blank() {
  const now = Date.now();
  return { id: newId(), title: "New chat", model: "", settings: { system: "" }, messages: [],
    created: now, updated: now };
}

function notice(text) {
  const box = $("notice");
  box.textContent = text;
  box.hidden = !text;
}

function fail(error) {
  if (error instanceof ApiError && error.status === 401) askKey(error.message);
  else notice(error.message || String(error));
}

async function save() {
  if (current.messages.length) await conversations.put(current);
  await showList();
}

const chat = new Chat({ conversation: () => current, save, notice, refused: fail });

// -- the list of conversations -----------------------------------------------------------

function matches(c, query) {
  if (!query) return true;
  const q = query.toLowerCase();
  return c.title.toLowerCase().includes(q) ||
    c.messages.some((m) => m.content.toLowerCase().includes(q));
}

async function showList() {
  const query = $("search").value.trim();
  const list = (await conversations.all()).filter((c) => matches(c, query));
  $("conversations").replaceChildren(...list.map((c) => {
    const open = button(c.title, "", () => openConversation(c.id), "conversation");
    if (c.id === current.id) open.setAttribute("aria-current", "true");
    const remove = button("✕", `Delete ${c.title}`, async () => {
      await conversations.remove(c.id);
      if (c.id === current.id) await openConversation(null);
      else await showList();
    });
    const item = element("li");
    item.append(open, remove);
    return item;
  }));
}

async function openConversation(id) {
  if (chat.busy) {
    notice("An answer is still coming: wait for it, or Stop it, to change conversations.");
    return;
  }
  const found = id ? await conversations.get(id) : null;
  current = found || blank();
  if (current.model) await refresh(current.model).catch(fail);
  notice("");
  chat.render();
  await showList();
  closeSidebar();
  $("prompt").focus();
}

function closeSidebar() {
  document.body.classList.remove("sidebar-open");
  $("open-sidebar").setAttribute("aria-expanded", "false");
}

// -- export and import ------------------------------------------------------------------

async function exportAll() {
  const blob = new Blob([exportJSON(await conversations.all())], { type: "application/json" });
  const link = element("a");
  link.href = URL.createObjectURL(blob);
  link.download = `llmrun-conversations-${new Date().toISOString().slice(0, 10)}.json`;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
}

async function importFile(file) {
  try {
    const list = parseImport(await file.text());
    for (const c of list) await conversations.put(c);
    notice("");
    $("live").textContent = `Imported ${list.length} conversation${list.length === 1 ? "" : "s"}.`;
    await showList();
  } catch (error) {
    notice(`Import failed: ${error.message}`);
  }
}

// -- the key ----------------------------------------------------------------------------

function askKey(message) {
  const dialog = $("key-dialog");
  const error = $("key-error");
  // the first refusal says a key is needed; after one was tried it says why it failed
  error.textContent = key.get() ? message : "";
  error.hidden = !key.get();
  if (!dialog.open) dialog.showModal();
  $("key").focus();
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  key.set($("key").value.trim());
  try {
    await refresh(current.model);
    $("key-dialog").close();
    notice("");
  } catch (error) {
    fail(error);
  }
});
$("key-dialog").addEventListener("cancel", (event) => event.preventDefault());  // nothing works without it

// -- wiring -----------------------------------------------------------------------------

$("new-chat").addEventListener("click", () => openConversation(null));
$("search").addEventListener("input", () => showList());
$("export").addEventListener("click", () => exportAll().catch(fail));
$("import").addEventListener("click", () => $("import-file").click());
$("import-file").addEventListener("change", async (event) => {
  const [file] = event.target.files;
  event.target.value = "";
  if (file) await importFile(file);
});
$("open-sidebar").addEventListener("click", () => {
  document.body.classList.add("sidebar-open");
  $("open-sidebar").setAttribute("aria-expanded", "true");
  $("search").focus();
});
$("close-sidebar").addEventListener("click", closeSidebar);
$("sidebar").addEventListener("keydown", (event) => {
  if (event.key === "Escape" && document.body.classList.contains("sidebar-open")) {
    closeSidebar();
    $("open-sidebar").focus();
  }
});
$("model").addEventListener("change", () => {
  current.model = $("model").value;
  localStorage.setItem("llmrun.model", current.model);
});
setUpSettings(() => current, async (settings) => {
  current.settings = settings;
  await save();
});
setUpPull((name) => refresh(name).catch(fail));
setUpStatus(fail);

async function start() {
  const [latest] = await conversations.all();
  if (latest) current = latest;
  try {
    const models = await refresh(current.model || localStorage.getItem("llmrun.model"));
    if (!models.length) notice("No model in the store yet: pull one.");
  } catch (error) {
    fail(error);
  }
  chat.render();
  await showList();
  document.body.dataset.ready = "true";  // for tests and scripts: the page is wired
}

start();
