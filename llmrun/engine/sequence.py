"""What the engine keeps of a request and of a KV slot: the request's parameters (`SeqParams`),
a sequence in flight (`Sequence`), a slot (`Slot`, one llama sequence id) and the engine's
step counters (`EngineStats`), with the events the engine emits.

Events (request id, kind, payload): a sequence placed in a slot first sends "started"
(`{"prompt_tokens", "cached_tokens", "n_ctx"}`: the cached prefix is known only then), then
"chunk"s, always a dict (`{"text"}`, plus `logprobs` or `prompt_logprobs` when asked), then
"done" with its statistics, or "error" (request.error_event: a code with its fields).

KV bookkeeping: `slot.tokens` is exactly the list of tokens whose keys/values sit in that
sequence's cells, positions 0..len-1. Images take positions like tokens, written in the
prompt as negative stand-in ids derived from their content hash (`image_ids`), so prefix
reuse works across images as across text; `slot.images` records which image starts where.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmrun.chat.textstream import TextStream
from llmrun.engine.backend import Sampler
from llmrun.engine.budget import ThoughtBudget
from llmrun.engine.draft import DRAFT_DEFAULT, DRAFT_MAX, Acceptance, History
from llmrun.engine.llama import ImageChunk, LlamaError
from llmrun.engine.promptcache import Entry
from llmrun.request import ChatRequest

Event = tuple[str, str, Any]  # (request id, "started" | "chunk" | "done" | "error", payload)

# The options that make a sequence's sampler chain (Options' names, engine/llama/ Sampler's).
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_last_n",
                 "repeat_penalty", "presence_penalty", "frequency_penalty", "seed")


@dataclass
class EngineStats:
    """Counters of the engine's steps since the runner started, and the latest budget: what
    /metrics shows of stall-free batching."""

    steps: int = 0
    step_seconds: float = 0.0
    mixed_steps: int = 0  # steps that read a prompt beside generating sequences
    prompt_tokens: int = 0  # prompt tokens read, in all steps
    step_seconds_max: float = 0.0  # the longest step since the last report
    budget_tokens: int = 0  # prompt tokens the last mixed step could read

    def payload(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        self.step_seconds_max = 0.0
        return out


def image_ids(digest: str, n: int) -> list[int]:
    """Stand-in token ids for the `n` positions of the image with content hash `digest`:
    negative (no token is one), int32 (prompt-cache keys are), and the same for the same
    image. Equal ids are not trusted alone: `Slot.images` confirms the content."""
    h = int.from_bytes(hashlib.blake2b(digest.encode(), digest_size=8).digest())
    return [-1 - (h + i) % 0x7FFFFFFE for i in range(n)]


@dataclass
class SeqParams:
    sampling: dict[str, Any]
    max_tokens: int = -1  # -1: until the context is full
    stops: list[str] = field(default_factory=list)
    # structured output: an llguidance LLMatcher for this sequence alone (None: free)
    matcher: Any = None
    # tool_choice "auto": a constraint.Lazy, whose matcher becomes `matcher` once the model
    # begins a tool call (None: no steering, or it has started or given up)
    lazy: Any = None
    # a thinking model: the matcher starts after this end-of-thought marker is generated
    # (the prompt left the output inside a thought, or the model may open one itself)
    constrain_after: bytes | None = None
    # the model may open a thought with this marker: when its first token starts one, the
    # matcher waits for `constrain_after`; otherwise it applies from that first token
    think_open: bytes | None = None
    logprobs: int | None = None  # None: off; 0: the sampled token's; k: also the top k
    pieces: dict[int, bytes] = field(default_factory=dict)  # text for tokens shown as nothing
    context: bool = False  # report prompt + output token ids when done (Ollama's `context`)
    # score the prompt itself: each prompt token's logprob given the ones before it (and the
    # top k), sent as chunks with `prompt_logprobs` before any output; the prompt is then
    # evaluated whole (cached cells carry no logits)
    prompt_logprobs: int | None = None
    # keep the prompt's state when this many of its tokens are in the slot (a message
    # boundary, engine/promptcache.py); None: at the end of the prompt
    save_at: int | None = None
    # a full context drops its oldest half after `keep` tokens and generation goes on,
    # rather than ending with "length" (Ollama's `shift`)
    shift: bool = False
    keep: int = 0
    truncated: tuple[int, int] = (0, 0)  # (messages, tokens) the runner dropped to fit
    # most tokens guessed by prompt lookup and checked in the same decode (engine/draft.py);
    # 0: none (the default: opt-in, see DRAFT_DEFAULT). A constrained sequence never drafts.
    draft: int = DRAFT_DEFAULT
    # the prompt's images: (index of its first position in the prompt, its chunk); their
    # positions hold image_ids
    images: list[tuple[int, ImageChunk]] = field(default_factory=list)
    session: str | None = None  # a realtime session's: its slot is kept for it (Slot.owner)
    # a thinking budget: the thought's end marker forced after so many of its tokens
    budget: ThoughtBudget | None = None

    @classmethod
    def of(cls, req: ChatRequest, **engine: Any) -> SeqParams:
        """The parameters of `req` (its options already merged with the model's defaults);
        `engine` adds what the runner builds itself (matcher, pieces, gates)."""
        o = req.options
        return cls(sampling={k: getattr(o, k) for k in SAMPLING_KEYS},
                   max_tokens=o.num_predict if o.num_predict is not None else -1,
                   stops=list(o.stop or []), logprobs=req.logprobs,
                   context=req.return_context, prompt_logprobs=req.prompt_logprobs,
                   shift=bool(o.shift), keep=max(0, o.num_keep or 0),
                   draft=DRAFT_DEFAULT if o.num_draft is None else min(o.num_draft, DRAFT_MAX),
                   session=req.session, **engine)


@dataclass
class Slot:
    seq_id: int
    tokens: list[int] = field(default_factory=list)
    seq: Sequence | None = None
    images: dict[int, str] = field(default_factory=dict)  # first position -> content hash
    # the realtime session whose sequence this slot keeps between its requests, until
    # `owned_until` (time.monotonic()): others take it only when no other slot is free
    owner: str | None = None
    owned_until: float = 0.0


@dataclass
class Sequence:
    id: str
    prompt: list[int]
    params: SeqParams
    submitted: float
    slot: Slot | None = None
    sampler: Sampler | None = None
    text: TextStream | None = None
    pending: list[int] = field(default_factory=list)  # tokens still to feed to the model
    cached: int = 0
    generated: int = 0
    output: list[int] = field(default_factory=list)  # only with params.context
    next_token: int | None = None
    t_start: float = 0.0
    t_first: float = 0.0
    # with a matcher: None once it applies; "after": inside a thought, waiting for
    # params.constrain_after; "maybe": the first token may open a thought (params.think_open)
    gate: str | None = None
    tail: bytes = b""  # the last bytes generated while gate is "after" (marker search)
    shifted: int = 0  # context tokens dropped by shifts
    # a saved state read for it off the engine thread (None when the read found nothing)
    prefetched: tuple[Entry, bytearray | None] | None = None
    kept: int = 0  # of them, the head that stayed in place
    # prompt lookup (engine/draft.py): the tokens so far, how often guesses came true, the
    # tokens drafted in this step's batch after next_token, and a guess made but not sent
    history: History | None = None
    accept: Acceptance = field(default_factory=Acceptance)
    drafts: list[int] = field(default_factory=list)
    shadow: int | None = None
    drafted: int = 0
    accepted: int = 0
    model_drafts: bool = False  # guessed ahead by the draft model (else by prompt lookup)
    encoding: bool = False  # its images are with the encoder thread (text is read meanwhile)
    embeds: dict[str, np.ndarray] = field(default_factory=dict)  # image hash -> its rows

    @property
    def blocked(self) -> bool:
        """Waiting for the encoder: its next positions are an image's, not encoded yet."""
        return self.encoding and bool(self.pending) and self.pending[0] < 0


class ConstraintError(ValueError):
    """The sequence's grammar failed (a dead end, a limit): that request's fault (400)."""



def describe(exc: BaseException) -> str:
    """An exception as a request's error message (its type where the text alone is vague)."""
    if isinstance(exc, LlamaError | ValueError) and str(exc):
        return str(exc)
    return f"generation failed: {type(exc).__name__}: {exc}" if str(exc) else \
        f"generation failed: {type(exc).__name__}"
