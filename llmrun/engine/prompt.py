"""A request's prompt: its chat template rendered and tokenized, images and sounds in their
places, the
oldest turns dropped to fit the context, where its shared head ends (for the prompt cache), and
fill-in-the-middle. What ModelHost (engine/host.py) hands the engine as tokens."""

from __future__ import annotations

import logging

from llmrun.chat import formats, templates, thinking, tools
from llmrun.engine import pixels, sound
from llmrun.engine.batcher import image_ids
from llmrun.engine.draft import common_prefix
from llmrun.engine.llama import ImageChunk, Model, Projector
from llmrun.engine.llama.vision import Picture, Sound
from llmrun.request import ChatRequest, Message

log = logging.getLogger("llmrun.runner")


class Prompter:
    """Renders requests for one model: its template, vocabulary and projector."""

    def __init__(self, model: Model, n_ctx_seq: int, n_image_rows: int,
                 projector: Projector | None = None) -> None:
        self.model = model
        self.n_ctx_seq = n_ctx_seq
        self.n_image_rows = n_image_rows  # most rows of one image (see render)
        self.projector = projector
        self.template = model.chat_template()
        self.bos_text = model.token_text(model.bos) if model.bos >= 0 else ""
        self.eos_text = model.token_text(model.eos) if model.eos >= 0 else ""
        self._control_pieces: dict[int, bytes] | None = None

    def source(self, req: ChatRequest) -> str:
        """The chat template `req` renders with, refused before anything (tool and
        thinking markers included) reads it if it is over the size limit."""
        source = req.template or self.template or templates.FALLBACK_TEMPLATE
        templates.check_size(source)
        return source

    def render(self, req: ChatRequest, plan: tools.ToolPlan | None = None,
               media: list[tuple[int, ImageChunk]] | None = None) -> tuple[list[int], str]:
        """The prompt's tokens and the text they came from (`plan`: tools.plan(req, source),
        when the caller has it already). Images in the messages take their positions as
        image_ids; each one's chunk, with the index of its first position, goes to `media`
        when it is given."""
        pictures = [item for m in req.messages for item in media_of(m)]
        if pictures and (req.prompt is not None or req.suffix is not None):
            raise ValueError("images and sounds need the chat template: a raw prompt cannot "
                             "carry them")
        if any(m.images for m in req.messages) and not (self.projector and self.projector.vision):
            raise ValueError("this model has no vision projector: it cannot read images")
        if any(m.audio for m in req.messages) and not (self.projector and self.projector.audio):
            raise ValueError("this model has no audio projector: it cannot hear sound")
        if req.suffix is not None:
            return self._fill_in_the_middle(req.prompt or "", req.suffix), ""
        if req.prompt is not None:
            text = req.prompt
            add_bos = self.model.add_bos
        else:
            source = self.source(req)
            if plan is None:
                plan = tools.plan(req, source)
            marked = [m.model_copy(update={"content": self._with_markers(m.content,
                                                                         media_of(m))})
                      if m.images or m.audio else m for m in req.messages]
            messages, extra = tools.chat_inputs(marked, req.system, source, plan)
            fmt = formats.detect(source)
            extra.update(fmt.template_vars(extra))
            if fmt.think_pair(source):
                extra.update(thinking.template_vars(req.think))
            text = templates.render(source, messages, bos_token=self.bos_text,
                                    eos_token=self.eos_text, **extra)
            # Most templates write the BOS token themselves; adding another hurts quality.
            add_bos = self.model.add_bos and not (self.bos_text and
                                                  text.startswith(self.bos_text))
        if pictures:
            tokens = self._tokenize_images(text, pictures, add_bos, media)
        else:
            tokens = self.model.tokenize(text, add_special=add_bos, parse_special=True)
        if req.context:
            if pictures:
                raise ValueError("images cannot follow a `context` of earlier token ids")
            tokens = self._after_context(req.context, tokens)
        return tokens, text

    def _with_markers(self, content: str, pictures: list[tuple[str, str]]) -> str:
        """A message's text with its images and sounds before it, as Ollama places images:
        one marker each (the projector's own, which no client can write), then a line."""
        assert self.projector is not None
        marks = "".join(self.projector.marker for _ in pictures)
        return f"{marks}\n{content}" if content else marks

    def _tokenize_images(self, text: str, pictures: list[tuple[str, str]], add_bos: bool,
                         media: list[tuple[int, ImageChunk]] | None) -> list[int]:
        """`text` (with a marker per image or sound) as tokens and media positions. They are
        decoded here, in the sandbox, each bounded before a pixel or sample is read
        (engine/pixels.py, engine/sound.py)."""
        projector = self.projector
        assert projector is not None
        marker = projector.marker
        between = text.split(marker)
        if len(between) != len(pictures) + 1:
            raise ValueError("the chat template dropped or repeated an image's place")
        # a sound may be read as several pieces (engine/sound.py): a marker for each
        decoded: list[Picture | Sound] = []
        continues: list[bool] = []  # each item: a sound's second or later piece
        text = between[0]
        for (kind, b64), after in zip(pictures, between[1:], strict=True):
            parts: list[Picture | Sound] = [pixels.decode(b64)] if kind == "image" else [
                *sound.decode(b64, projector.decode_sound, projector.sample_rate,
                              projector.piece_seconds)]
            decoded += parts
            continues += [i > 0 for i in range(len(parts))]
            text += marker * len(parts) + after
        chunks = projector.tokenize(text, decoded, add_bos)
        tokens: list[int] = []
        item = -1
        for i, part in enumerate(chunks):
            if not isinstance(part, ImageChunk):
                nxt = chunks[i + 1] if i + 1 < len(chunks) else None
                if i > 0 and isinstance(chunks[i - 1], ImageChunk) \
                        and isinstance(nxt, ImageChunk) and nxt.digest.endswith(".0") \
                        and continues[item + 1]:
                    # the projector's end and begin marks between two pieces of one sound:
                    # the model hears one sound, as it would the whole file
                    continue
                tokens += part
                continue
            if part.digest.endswith(".0"):
                item += 1  # an image's or a piece's first chunk
            if part.n_tokens > self.n_image_rows:
                raise ValueError(f"an image or a piece of sound takes {part.n_tokens} "
                                 f"positions; this model "
                                 f"was loaded for at most {self.n_image_rows} (num_batch)")
            if media is not None:
                media.append((len(tokens), part))
            tokens += image_ids(part.digest, part.n_tokens)
        if tokens and tokens[-1] < 0:
            raise ValueError("a prompt cannot end with an image or sound: text must follow "
                             "it")
        return tokens

    def truncate(self, req: ChatRequest, plan: tools.ToolPlan | None, prompt: list[int],
                  text: str) -> tuple[ChatRequest, list[int], str, tuple[int, int]]:
        """`req` without its oldest turns, as few as make it fit the context (Ollama's
        `truncate`): system messages and the last user turn always stay; a turn goes whole
        (a user message and what answered it), so no tool result loses its call. Returns
        the request, its prompt and text, and (messages, tokens) dropped; the request as it
        was when dropping every earlier turn is not enough."""
        if req.prompt is not None or req.suffix is not None:
            return req, prompt, text, (0, 0)
        history = [i for i, m in enumerate(req.messages) if m.role != "system"]
        users = [i for i in history if req.messages[i].role == "user"]
        starts = [i for i in users if i > history[0]] if history else []  # turns after the first

        def without(k: int) -> ChatRequest:
            """`req` less every non-system message before the k-th later turn's start."""
            cut = starts[k - 1]
            kept = [m for i, m in enumerate(req.messages) if m.role == "system" or i >= cut]
            return req.model_copy(update={"messages": kept})

        lo, hi = 1, len(starts)  # the fewest turns to drop, by bisection: renders are costly
        best: tuple[ChatRequest, list[int], str] | None = None
        while lo <= hi:
            mid = (lo + hi) // 2
            candidate = without(mid)
            tokens, rendered = self.render(candidate, plan)
            if len(tokens) < self.n_ctx_seq:
                best, hi = (candidate, tokens, rendered), mid - 1
            else:
                lo = mid + 1
        if best is None:
            return req, prompt, text, (0, 0)
        short, tokens, rendered = best
        dropped = len(req.messages) - len(short.messages)
        log.info("truncated the prompt: %d oldest messages (%d tokens) dropped to fit %d",
                 dropped, len(prompt) - len(tokens), self.n_ctx_seq)
        return short, tokens, rendered, (dropped, len(prompt) - len(tokens))

    def boundary(self, req: ChatRequest, plan: tools.ToolPlan | None, prompt: list[int],
                  min_tokens: int = 1) -> int | None:
        """How many tokens of `prompt` come before the text of its last user message: what a
        new session with the same system prompt and tools, or the next turn, shares with it,
        so where its state is kept (engine/promptcache.py). Found by rendering the request
        with that text left out, not the messages before it: some templates (Gemma's) write
        the system prompt inside the first user turn. None for a raw prompt, or when fewer
        than `min_tokens` come before that message (not worth a state of their own)."""
        if req.prompt is not None or req.suffix is not None or req.context:
            return None
        users = [i for i, m in enumerate(req.messages) if m.role == "user"]
        if not users:
            return None
        messages = list(req.messages)
        messages[users[-1]] = messages[users[-1]].model_copy(update={"content": ""})
        try:
            tokens, _ = self.render(req.model_copy(update={"messages": messages}), plan)
        except Exception:  # a template that refuses an empty message: no boundary
            return None
        n = common_prefix(tokens, prompt)
        # a short head is not worth a state of its own: the whole prompt's is kept instead
        return n if n >= min_tokens else None

    def _fill_in_the_middle(self, prefix: str, suffix: str) -> list[int]:
        """Prefix-suffix-middle order with the model's FIM tokens, as llama-server builds it."""
        fim = self.model.fim_tokens()
        if fim is None:
            raise ValueError("this model does not support insert (fill-in-the-middle with "
                             "'suffix'): its vocabulary has no FIM tokens")
        pre, suf, mid = fim
        head = [self.model.bos] if self.model.add_bos and self.model.bos >= 0 else []
        return [*head, pre, *self.model.tokenize(prefix, add_special=False, parse_special=False),
                suf, *self.model.tokenize(suffix, add_special=False, parse_special=False), mid]

    def _after_context(self, context: list[int], tokens: list[int]) -> list[int]:
        """Ollama's `context`: an earlier exchange's tokens, then the new prompt (whose BOS,
        if any, would be a second one)."""
        if any(not 0 <= t < self.model.n_vocab for t in context):
            raise ValueError(f"context holds token ids outside this model's vocabulary "
                             f"(0..{self.model.n_vocab - 1}); it came from another model?")
        if tokens and tokens[0] == self.model.bos and context[:1] == [self.model.bos]:
            tokens = tokens[1:]
        return [*context, *tokens]


    def control_pieces(self) -> dict[int, bytes]:
        """Tool-call markers that are control tokens in this vocabulary (rendered as nothing
        by default), as the text the tool parser looks for."""
        if self._control_pieces is None:
            self._control_pieces = {}
            for marker in (*tools.CONTROL_MARKERS, *thinking.CONTROL_MARKERS,
                           *formats.CONTROL_MARKERS):
                toks = self.model.tokenize(marker, add_special=False, parse_special=True)
                if len(toks) == 1 and not self.model.piece(toks[0]):
                    self._control_pieces[toks[0]] = marker.encode()
        return self._control_pieces



def media_of(m: Message) -> list[tuple[str, str]]:
    """A message's images, then its sounds, as (kind, base64): the order of their markers."""
    return [*(("image", b) for b in m.images), *(("audio", b) for b in m.audio)]
