// The model picker (from /api/tags, loaded ones marked from /api/ps), what each model can do
// (/api/show), pulling a model with its progress, and the status view of what is loaded.

import { api } from "./api.js";
import { $, button, closers, element } from "./dom.js";

const capabilities = new Map();  // model name -> Promise of its capability list
let loaded = new Map();  // model name -> its /api/ps entry

export function contextSize(model) {
  return loaded.get(model)?.context_length || 0;
}

export async function refresh(selected) {
  const [tags, ps] = await Promise.all([api.tags(), api.ps()]);
  loaded = new Map(ps.models.map((m) => [m.name, m]));
  const picker = $("model");
  const keep = selected || picker.value;
  picker.replaceChildren(...tags.models.map((m) => {
    const option = element("option", "", loaded.has(m.name) ? `${m.name} ● loaded` : m.name);
    option.value = m.name;
    return option;
  }));
  if (tags.models.some((m) => m.name === keep)) picker.value = keep;
  return tags.models;
}

export function canSee(model) {
  if (!capabilities.has(model)) {
    capabilities.set(model, api.show(model).then((s) => s.capabilities || [],
      (error) => { capabilities.delete(model); throw error; }));
  }
  return capabilities.get(model).then((list) => list.includes("vision"));
}

export function setUpPull(onPulled) {
  const dialog = $("pull-dialog");
  const progress = $("pull-progress");
  const status = $("pull-status");
  let pulling = false;
  // closing the dialog does not stop a pull (the daemon goes on downloading anyway): it
  // ends in the background and the model then appears in the picker
  closers(dialog);
  $("pull-open").addEventListener("click", () => {
    if (!pulling) {  // a pull under way keeps showing its progress
      status.textContent = "";
      progress.hidden = true;
    }
    dialog.showModal();
  });
  $("pull-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    if (pulling) return;
    const name = $("pull-name").value.trim();
    pulling = true;
    $("pull-start").disabled = true;
    status.textContent = `Pulling ${name}…`;
    try {
      for await (const e of api.pull(name)) {
        if (e.total) {
          progress.hidden = false;
          progress.max = e.total;
          progress.value = e.completed || 0;
          const percent = Math.floor((100 * (e.completed || 0)) / e.total);
          status.textContent = `${e.status}: ${percent}%`;
        } else {
          status.textContent = e.status;
        }
      }
      status.textContent = `${name} is ready.`;
      onPulled(name);
    } catch (error) {
      status.textContent = `Pull failed: ${error.message}`;
    } finally {
      pulling = false;
      $("pull-start").disabled = false;
    }
  });
}

function mb(bytes) {
  return bytes ? `${(bytes / 2 ** 20).toFixed(0)} MB` : "—";
}

export function setUpStatus(onError) {
  const dialog = $("status-dialog");
  closers(dialog);
  const show = async () => {
    const { models } = await api.ps();
    loaded = new Map(models.map((m) => [m.name, m]));
    $("status-rows").replaceChildren(...models.map((m) => {
      const row = element("tr");
      const until = m.expires_at ? new Date(m.expires_at).toLocaleTimeString() : "—";
      const context = m.remote ? "remote" : String(m.context_length || "—");
      row.append(...[m.name, mb(m.size), context, until].map((text) => element("td", "", text)));
      const cell = element("td");
      if (!m.remote) {
        const unload = button("Unload", `Unload ${m.name}`, async () => {
          unload.disabled = true;
          try {
            await api.unload(m.name);
            await show();
          } catch (error) {
            onError(error);
          }
        }, "");
        cell.append(unload);
      }
      row.append(cell);
      return row;
    }));
    $("status-empty").hidden = models.length > 0;
  };
  $("status-open").addEventListener("click", async () => {
    try {
      await show();
      dialog.showModal();
    } catch (error) {
      onError(error);
    }
  });
}
