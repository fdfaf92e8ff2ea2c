"""Reranking with a causal model (Qwen3-Reranker style): a document's score is
p(yes) / (p(yes) + p(no)) from the logits at the end of a prompt asking whether it meets the
query; the rest of the vocabulary does not count.

Like the embedder, it has a llama context and a worker thread of its own
(engine/sidework.py), so scoring a few hundred documents never stalls the decode loop of the
generation context. Documents are
packed several to a decode (one sequence each, prompts of one length together, several
requests' documents alike: see SideWorker._groups); only each sequence's last token asks for
logits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from llmrun.engine.llama import Context, LlamaError, Model
from llmrun.engine.sidework import Job, Read, SideWorker
from llmrun.request import ChatRequest, Message

MAX_SEQ = 4

# Qwen3-Reranker's published prompt (its model card): what a model trained that way expects,
# and a reasonable question for any chat model asked to judge relevance.
DEFAULT_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and '
                  'the Instruct provided. Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = ("Given a web search query, retrieve relevant passages that answer the "
                       "query")
DEFAULT_USER = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
DEFAULT_YES, DEFAULT_NO = "yes", "no"

_FIELDS = re.compile(r"\{(query|document|instruction)\}")

Render = Callable[[ChatRequest], tuple[list[int], str]]


class RerankError(ValueError):
    pass


def fill(template: str, values: dict[str, str]) -> str:
    """`template` with {query}, {document} and {instruction} replaced in one pass, so that a
    query holding the text "{document}" stays as written."""
    return _FIELDS.sub(lambda m: values[m.group(1)], template)


def score(yes_logit: float, no_logit: float) -> float:
    """p(yes) / (p(yes) + p(no)): the softmax's normaliser cancels, leaving a logistic of the
    difference, computed so that neither side overflows."""
    d = float(yes_logit) - float(no_logit)
    if d >= 0:
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)


def prompt_request(req: ChatRequest, query: str, document: str) -> ChatRequest:
    """The request whose prompt scores `document` for `query`: `rerank_template` as a raw
    prompt, or the chat template over Qwen3-Reranker's turns, thinking switched off (a
    Qwen3 template then opens the answer with an empty thought, as the reranker was trained)."""
    o = req.options
    values = {"query": query, "document": document,
              "instruction": o.rerank_instruction or DEFAULT_INSTRUCTION}
    if o.rerank_template is not None:
        return ChatRequest(model=req.model, messages=[], prompt=fill(o.rerank_template, values))
    return ChatRequest(model=req.model, template=req.template, think=False, messages=[
        Message(role="system", content=DEFAULT_SYSTEM),
        Message(role="user", content=fill(DEFAULT_USER, values))])


class Reranker(SideWorker):
    name = "llmrun-rerank"
    what = "reranking"
    # ValueError: a template that fails to render (chat.templates.TemplateError) as well
    request_errors = (RerankError, LlamaError, ValueError)
    n_seq = MAX_SEQ
    last_only = True  # the answer's logits, after the prompt's last token

    def __init__(self, model: Model, render: Render, n_ctx_seq: int, n_threads: int,
                 reply: Callable[[str, str, Any], None],
                 heartbeat: Callable[[], None] | None = None) -> None:
        self.render = render  # Prompter.render: the chat path's tokens for the same text
        super().__init__(model, n_ctx_seq, n_threads, reply, heartbeat)

    def submit(self, req_id: str, req: ChatRequest, query: str, documents: list[str],
               offset: int = 0) -> None:
        """Queue `documents` (`offset`: the index of the first in the caller's whole list,
        for error messages about a batch the daemon sent in pieces)."""
        self.queue(req_id, req, query, documents, offset)

    def answer_token(self, text: str, which: str) -> int:
        """The one token `text` is in this vocabulary (special tokens parsed, as in the
        prompt); a text of several tokens cannot be scored as one answer."""
        tokens = self.model.tokenize(text, add_special=False, parse_special=True)
        if len(tokens) != 1:
            raise RerankError(f"rerank_{which} {text!r} is {len(tokens)} tokens in this "
                              "model's vocabulary; it must be exactly one")
        return tokens[0]

    def prompt(self, req: ChatRequest, query: str, document: str) -> list[int]:
        """The tokens that score `document` for `query`."""
        tokens, _ = self.render(prompt_request(req, query, document))
        return tokens

    def reader(self, req: ChatRequest) -> Read:
        """What makes a score of a prompt's decode: p(yes) / (p(yes) + p(no)) from the
        logits after its last token."""
        o = req.options
        yes = self.answer_token(o.rerank_yes or DEFAULT_YES, "yes")
        no = self.answer_token(o.rerank_no or DEFAULT_NO, "no")

        def read(ctx: Context, seq: int, row: int) -> float:
            logits = ctx.logits(row)
            return score(logits[yes], logits[no])

        return read

    def prepare(self, req: ChatRequest, query: str, documents: list[str],
                offset: int = 0) -> Job:
        read = self.reader(req)
        prompts = []
        for i, doc in enumerate(documents):
            tokens = self.prompt(req, query, doc)
            if len(tokens) > self.n_ctx_seq:
                raise RerankError(f"document {offset + i}: its prompt is {len(tokens)} tokens "
                                  f"but the context is {self.n_ctx_seq} (num_ctx); shorten "
                                  "it or raise num_ctx")
            if not tokens:
                raise RerankError("the rerank prompt rendered to no tokens")
            prompts.append(tokens)

        def finish(scores: list[Any]) -> tuple[str, dict[str, Any]]:
            for i, value in enumerate(scores):
                if not math.isfinite(value):
                    raise LlamaError(f"document {offset + i}: the model's output is not "
                                     "finite")
            return "rerank", {"scores": scores, "prompt_tokens": sum(len(p) for p in prompts)}

        return Job(prompts, read, finish)
