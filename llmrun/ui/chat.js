// The conversation view: messages, the streaming answer, Stop, regenerate, edit-and-resend,
// attached images and the numbers after each answer.

import { api } from "./api.js";
import { $, button, element } from "./dom.js";
import { canSee, contextSize, refresh } from "./models.js";
import { markdown } from "./render.js";
import { options } from "./settings.js";

const MAX_IMAGE_BYTES = 20 * 2 ** 20;

function base64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1] || "");
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// The type of an image from its first bytes (base64), for a data: URL that says it
const MAGIC = { iVBOR: "image/png", "/9j/": "image/jpeg", R0lG: "image/gif", UklG: "image/webp" };

function imageType(data) {
  const found = Object.keys(MAGIC).find((prefix) => data.startsWith(prefix));
  return found ? MAGIC[found] : "application/octet-stream";
}

function statsText(stats) {
  const parts = [];
  if (Number.isFinite(stats.tokens_per_s)) parts.push(`${stats.tokens_per_s.toFixed(1)} tokens/s`);
  if (Number.isFinite(stats.context_used)) {
    parts.push(stats.context_size
      ? `context ${stats.context_used} of ${stats.context_size} tokens`
      : `context ${stats.context_used} tokens`);
  }
  return parts.join(" · ");
}

// Re-renders a streaming answer. The first text at once (the wait for it is what a user
// feels), then at most once a frame. Each paint parses the whole answer again, so a long
// one costs more: after a paint of t ms the next waits 2t, and painting never takes over a
// third of the time (the stream is read meanwhile; the last paint shows all of it).
class Painter {
  constructor(paint) {
    this.paint = paint;
    this.frame = 0;
    this.shown = false;
    this.calmUntil = 0;
  }

  update(visible) {
    if (this.frame) return;
    if (!this.shown && visible) {
      this.shown = true;
      this.timed();
      return;
    }
    const tick = (now) => {
      this.frame = now < this.calmUntil ? requestAnimationFrame(tick) : 0;
      if (!this.frame) this.timed();
    };
    this.frame = requestAnimationFrame(tick);
  }

  timed() {
    const start = performance.now();
    this.paint();
    const end = performance.now();
    this.calmUntil = end + 2 * (end - start);
  }

  cancel() {
    cancelAnimationFrame(this.frame);
    this.frame = 0;
  }
}

export class Chat {
  // conversation(): the open conversation; save(): store it; notice(text): show an error;
  // refused(error): the daemon wants a (new) key
  constructor({ conversation, save, notice, refused }) {
    this.conversation = conversation;
    this.save = save;
    this.notice = notice;
    this.refused = refused;
    this.controller = null;
    this.pending = [];  // images attached to the next message: {data (base64), url}
    this.opened = new WeakSet();  // messages whose thinking the user opened
    this.list = $("messages");
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.controller?.abort());
    $("attach").addEventListener("click", () => $("image-file").click());
    $("image-file").addEventListener("change", async (event) => {
      await this.attach([...event.target.files]);
      event.target.value = "";
    });
    $("prompt").addEventListener("paste", (event) => {
      const files = [...(event.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
      if (files.length) {
        event.preventDefault();
        this.attach(files);
      }
    });
    const composer = $("composer");
    composer.addEventListener("dragover", (event) => {
      event.preventDefault();
      composer.classList.add("dropping");
    });
    composer.addEventListener("dragleave", () => composer.classList.remove("dropping"));
    composer.addEventListener("drop", (event) => {
      event.preventDefault();
      composer.classList.remove("dropping");
      this.attach([...(event.dataTransfer?.files || [])]);
    });
  }

  get model() {
    return $("model").value;
  }

  get busy() {
    return this.controller !== null;
  }

  // -- images ---------------------------------------------------------------------------

  async attach(files) {
    const images = files.filter((f) => f.type.startsWith("image/"));
    if (!images.length) {
      if (files.length) this.notice("Only images can be attached.");
      return;
    }
    const model = this.model;
    let vision = false;
    try {
      vision = await canSee(model);
    } catch (error) {
      this.notice(error.message);
      return;
    }
    if (!vision) {
      this.notice(`${model} cannot read images: it has no vision projector. ` +
        "Pick a vision model to attach images.");
      return;
    }
    for (const file of images) {
      if (file.size > MAX_IMAGE_BYTES) {
        this.notice(`${file.name} is larger than 20 MB.`);
        continue;
      }
      this.pending.push({ data: await base64(file), url: URL.createObjectURL(file), name: file.name });
    }
    this.showAttachments();
  }

  showAttachments() {
    $("attachments").replaceChildren(...this.pending.map((image, i) => {
      const item = element("li");
      const img = element("img");
      img.src = image.url;
      img.alt = image.name || `image ${i + 1}`;
      item.append(img, button("✕", `Remove ${img.alt}`, () => {
        URL.revokeObjectURL(image.url);
        this.pending.splice(i, 1);
        this.showAttachments();
      }));
      return item;
    }));
  }

  // -- showing --------------------------------------------------------------------------

  render() {
    const messages = this.conversation().messages;
    this.list.replaceChildren(...messages.map((m, i) => this.messageView(m, i, messages)));
  }

  messageView(m, index, messages) {
    const view = element("article", `msg ${m.role}`);
    view.dataset.index = String(index);
    view.append(element("h3", "who", m.role === "user" ? "You" : m.role === "assistant"
      ? (m.model || "Assistant") : "System"));
    if (m.thinking) {
      const details = element("details", "thinking");
      // re-rendered each frame while it streams: it stays as the user left it
      details.open = this.opened.has(m);
      details.addEventListener("toggle", () => {
        if (details.open) this.opened.add(m);
        else this.opened.delete(m);
      });
      details.append(element("summary", "", m.streaming && !m.content ? "Thinking…" : "Thinking"),
        element("div", "thought", m.thinking));  // plain text, never parsed as HTML
      view.append(details);
    }
    if (m.images?.length) {
      const row = element("div", "images");
      for (const [i, data] of m.images.entries()) {
        const img = element("img");
        img.src = `data:${imageType(data)};base64,${data}`;  // the user's own picture
        img.alt = `attached image ${i + 1}`;
        row.append(img);
      }
      view.append(row);
    }
    const body = element("div", "body");
    if (m.role === "assistant") body.append(markdown(m.content));
    else body.textContent = m.content;  // what the user wrote is shown as written
    view.append(body);
    const foot = element("div", "foot");
    if (m.error) foot.append(element("span", "error", m.error));
    if (m.stopped) foot.append(element("span", "stopped", "Stopped"));
    if (m.cut) foot.append(element("span", "stopped", "Cut at the token limit"));
    if (m.stats) foot.append(element("span", "stats", statsText(m.stats)));
    if (!this.busy && m.role === "user") {
      foot.append(button("Edit", "Edit and resend this message", () => this.edit(view, index)));
    }
    if (!this.busy && m.role === "assistant" && index === messages.length - 1) {
      foot.append(button("Regenerate", "Regenerate this answer", () => this.regenerate()));
    }
    view.append(foot);
    return view;
  }

  edit(view, index) {
    const m = this.conversation().messages[index];
    const body = view.querySelector(".body");
    const box = element("textarea", "edit");
    box.value = m.content;
    box.setAttribute("aria-label", "Edited message");
    const actions = element("div", "row");
    actions.append(
      button("Cancel", "Cancel the edit", () => this.render()),
      button("Send", "Send the edited message", () => {
        const conversation = this.conversation();
        conversation.messages = [...conversation.messages.slice(0, index),
          { ...m, content: box.value }];
        this.answer();
      }),
    );
    body.replaceChildren(box, actions);
    box.focus();
  }

  regenerate() {
    const conversation = this.conversation();
    if (conversation.messages.at(-1)?.role === "assistant") conversation.messages.pop();
    this.answer();
  }

  // -- asking ---------------------------------------------------------------------------

  async send() {
    if (this.busy) return;
    const text = $("prompt").value.trim();
    if (!text && !this.pending.length) return;
    if (!this.model) {
      this.notice("Pick a model first (or pull one).");
      return;
    }
    if (this.pending.length && !(await canSee(this.model).catch(() => false))) {
      this.notice(`${this.model} cannot read images: it has no vision projector.`);
      return;
    }
    const message = { role: "user", content: text };
    if (this.pending.length) message.images = this.pending.map((p) => p.data);
    for (const p of this.pending) URL.revokeObjectURL(p.url);
    this.pending = [];
    this.showAttachments();
    $("prompt").value = "";
    const conversation = this.conversation();
    if (!conversation.messages.some((m) => m.role === "user")) {
      conversation.title = (text || "Image").slice(0, 60);
    }
    conversation.messages.push(message);
    await this.answer();
  }

  async answer() {
    const conversation = this.conversation();
    conversation.model = this.model;
    const history = conversation.messages.map((m) => {
      const out = { role: m.role, content: m.content };
      if (m.images?.length) out.images = m.images;
      return out;
    });
    if (conversation.settings.system) {
      history.unshift({ role: "system", content: conversation.settings.system });
    }
    const reply = { role: "assistant", content: "", model: conversation.model, streaming: true };
    conversation.messages.push(reply);
    this.controller = new AbortController();
    this.setBusy(true);
    this.render();
    const view = this.list.lastElementChild;
    view.scrollIntoView({ block: "end" });
    const painter = new Painter(() => {
      // follow the answer down, unless the user scrolled up to read
      const list = this.list;
      const following = list.scrollHeight - list.scrollTop - list.clientHeight < 48;
      const fresh = this.messageView(reply, conversation.messages.length - 1, conversation.messages);
      view.replaceChildren(...fresh.childNodes);
      if (following) list.scrollTop = list.scrollHeight;
    });
    let last = null;
    try {
      for await (const chunk of api.chat({ model: conversation.model, messages: history,
        options: options(conversation.settings) }, this.controller.signal)) {
        if (chunk.message?.content) reply.content += chunk.message.content;
        if (chunk.message?.thinking) reply.thinking = (reply.thinking || "") + chunk.message.thinking;
        if (chunk.done) last = chunk;
        painter.update(Boolean(reply.content || reply.thinking));
      }
    } catch (error) {
      if (error.name === "AbortError") reply.stopped = true;
      else reply.error = error.message;
      if (error.status === 401) this.refused(error);
    }
    painter.cancel();
    delete reply.streaming;
    this.controller = null;
    if (last) {
      await refresh(conversation.model).catch(() => {});  // the loaded mark, the context size
      const used = (last.prompt_eval_count || 0) + (last.eval_count || 0);
      reply.stats = { context_used: used,
        context_size: conversation.settings.num_ctx || contextSize(conversation.model) };
      if (last.done_reason === "length") reply.cut = true;  // num_predict or a full context
      if (last.eval_count && last.eval_duration) {
        reply.stats.tokens_per_s = last.eval_count / (last.eval_duration / 1e9);
      }
    }
    conversation.updated = Date.now();
    await this.save();
    this.setBusy(false);
    this.render();
    $("live").textContent = reply.error ? `Error: ${reply.error}`
      : reply.stopped ? "Answer stopped." : "Answer complete.";
  }

  setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    this.list.setAttribute("aria-busy", String(busy));  // read the answer once it is whole
    if (busy) $("stop").focus();
    else $("prompt").focus();
  }
}
