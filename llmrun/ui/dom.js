// Small DOM helpers shared by the views. Text goes in as text (textContent), never as HTML.

export const $ = (id) => document.getElementById(id);

export function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// A button; `label` names it for screen readers where its text alone would not ("✕")
export function button(text, label, onClick, className = "link") {
  const node = element("button", className, text);
  node.type = "button";
  if (label) node.setAttribute("aria-label", label);
  node.addEventListener("click", onClick);
  return node;
}

// The dialog's buttons marked data-close close it
export function closers(dialog) {
  for (const node of dialog.querySelectorAll("[data-close]")) {
    node.addEventListener("click", () => dialog.close());
  }
}
