// A conversation's system prompt and sampling options; empty fields mean the model's default.

import { $, closers } from "./dom.js";

export const NUMBERS = ["temperature", "top_p", "num_ctx", "num_predict", "seed"];

// The options of an /api/chat request from a conversation's settings.
export function options(settings) {
  const out = {};
  for (const name of NUMBERS) {
    if (Number.isFinite(settings[name])) out[name] = settings[name];
  }
  return out;
}

export function setUpSettings(current, save) {
  const dialog = $("settings-dialog");
  closers(dialog);
  $("settings-open").addEventListener("click", () => {
    const settings = current().settings;
    $("system").value = settings.system || "";
    for (const name of NUMBERS) $(name).value = settings[name] ?? "";
    dialog.showModal();
  });
  $("settings-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const settings = { system: $("system").value };
    for (const name of NUMBERS) {
      const field = $(name);
      if (field.value !== "" && Number.isFinite(field.valueAsNumber)) {
        settings[name] = field.valueAsNumber;
      }
    }
    save(settings);
    dialog.close();
  });
}
