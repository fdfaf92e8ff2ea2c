// Model output to DOM: Markdown (marked) to HTML, then DOMPurify to an inert fragment, then
// what may not load is made text. Model output is untrusted: a poisoned document or a hostile
// fine-tune can make it write `<img onerror>`, `<script>` or a `javascript:` link, and on this
// page (the daemon's origin) a script could drive every API route. Nothing here assigns a
// string as HTML: the page's CSP enforces Trusted Types, and only DOMPurify holds a policy.

import { button, element } from "./dom.js";
import { marked } from "./vendor/marked/marked.esm.js";
import DOMPurify from "./vendor/dompurify/purify.es.mjs";
import hljs from "./vendor/highlight/core.min.js";
import bash from "./vendor/highlight/languages/bash.min.js";
import c from "./vendor/highlight/languages/c.min.js";
import cpp from "./vendor/highlight/languages/cpp.min.js";
import css from "./vendor/highlight/languages/css.min.js";
import diff from "./vendor/highlight/languages/diff.min.js";
import go from "./vendor/highlight/languages/go.min.js";
import java from "./vendor/highlight/languages/java.min.js";
import javascript from "./vendor/highlight/languages/javascript.min.js";
import json from "./vendor/highlight/languages/json.min.js";
import python from "./vendor/highlight/languages/python.min.js";
import rust from "./vendor/highlight/languages/rust.min.js";
import sql from "./vendor/highlight/languages/sql.min.js";
import typescript from "./vendor/highlight/languages/typescript.min.js";
import xml from "./vendor/highlight/languages/xml.min.js";
import yaml from "./vendor/highlight/languages/yaml.min.js";

for (const [name, grammar] of Object.entries({
  bash, c, cpp, css, diff, go, java, javascript, json, python, rust, sql, typescript, xml, yaml,
})) {
  hljs.registerLanguage(name, grammar);
}

// What Markdown produces, and nothing else: no style, form, frame, SVG, MathML or media.
const MARKDOWN = {
  ALLOWED_TAGS: ["a", "b", "blockquote", "br", "code", "del", "em", "h1", "h2", "h3", "h4",
    "h5", "h6", "hr", "i", "img", "kbd", "li", "ol", "p", "pre", "s", "strong", "sub", "sup",
    "table", "tbody", "td", "tfoot", "th", "thead", "tr", "ul"],
  // img keeps src and alt only to be shown as text (below); class only as code's language
  ALLOWED_ATTR: ["href", "title", "alt", "src", "start", "align", "class"],
  ALLOW_DATA_ATTR: false,
  ALLOW_ARIA_ATTR: false,
  RETURN_DOM_FRAGMENT: true,
};
// highlight.js's output: spans with its classes
const HIGHLIGHT = { ALLOWED_TAGS: ["span"], ALLOWED_ATTR: ["class"], RETURN_DOM_FRAGMENT: true };
const LINK_SCHEMES = new Set(["http:", "https:", "mailto:"]);

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.hasAttribute("class")) {
    // a class of the page's own (say "msg user") would let output pose as the page's UI
    const names = node.getAttribute("class").trim().split(/\s+/);
    const keep = node.tagName === "CODE"
      ? names.length === 1 && /^language-[\w+#-]{1,30}$/.test(names[0])
      : node.tagName === "SPAN" && names.every((n) => /^hljs-[\w-]+$|^[a-z]+_+$/.test(n));
    if (!keep) node.removeAttribute("class");
  }
  if (node.tagName === "A") {
    const href = node.getAttribute("href");
    // absolute http(s) and mailto only: javascript:, data:, vbscript: and links into the
    // daemon's own origin (relative ones) are dropped, the link text stays
    let ok = false;
    try {
      ok = href !== null && /^[a-z]+:/i.test(href.trim()) &&
        LINK_SCHEMES.has(new URL(href.trim()).protocol);
    } catch {
      ok = false;
    }
    if (!ok) {
      node.removeAttribute("href");
    } else {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  }
});

// An image in model output is never loaded (it would tell a server what the page shows): its
// alt text and address are shown as text instead.
function imageAsText(img) {
  const alt = img.getAttribute("alt") || "image";
  const src = (img.getAttribute("src") || "").slice(0, 300);
  return element("span", "img-text", src ? `[${alt}: ${src}]` : `[${alt}]`);
}

function highlight(code) {
  const lang = /^language-(.+)$/.exec(code.getAttribute("class") || "")?.[1];
  if (!lang || !hljs.getLanguage(lang)) return;
  const html = hljs.highlight(code.textContent, { language: lang, ignoreIllegals: true }).value;
  code.replaceChildren(DOMPurify.sanitize(html, HIGHLIGHT));
  code.classList.add("hljs");
}

function withCopyButton(pre) {
  const box = element("div", "code");
  const copy = button("Copy", "Copy the code", async () => {
    try {
      await navigator.clipboard.writeText(pre.textContent);
      copy.textContent = "Copied";
    } catch {
      // no clipboard permission: select the code, so Ctrl+C copies it
      getSelection().selectAllChildren(pre);
      copy.textContent = "Press Ctrl+C";
    }
    setTimeout(() => { copy.textContent = "Copy"; }, 1500);
  }, "copy");
  pre.replaceWith(box);
  box.append(copy, pre);
}

export function markdown(text) {
  const html = marked.parse(text, { gfm: true, breaks: false, async: false });
  const fragment = DOMPurify.sanitize(html, MARKDOWN);
  // still inert (DOMPurify parsed it in a document of its own): nothing has loaded yet
  for (const img of fragment.querySelectorAll("img")) img.replaceWith(imageAsText(img));
  for (const code of fragment.querySelectorAll("pre > code")) highlight(code);
  for (const pre of fragment.querySelectorAll("pre")) withCopyButton(pre);
  return fragment;
}
