"""Reranking with a cross-encoder: a model whose GGUF declares rank pooling (bge-reranker,
jina-reranker, ms-marco MiniLM and other BERT/XLM-R sequence classifiers; Qwen3-Reranker as
llama.cpp converts it) reads the query and a document as one input, and its classification
head's output is the document's score.

The pair is built as llama-server builds it for /v1/rerank (format_prompt_rerank): the GGUF's
"rerank" template with {query} and {document} when it has one, else BOS query [EOS] [SEP]
document [EOS] as the vocabulary's flags ask (Model.pair_tokens). It is decoded on a pooled
context with rank pooling by the side worker's loop (engine/sidework.py): for an encoder
(BERT, XLM-R) one request's pairs in order, as many to a decode as fit; for a causal model
(Qwen3) several of one length, from any request.

The score is sigmoid(head output) for a one-label head, so relevance_score lies in [0, 1]
like the LLM reranker's p(yes) / (p(yes) + p(no)), and is what sentence-transformers'
CrossEncoder and Hugging Face TEI return for such a head (llama-server returns the raw
logit; the order of the documents is the same). A graph that ends in a softmax over
["yes", "no"] (Qwen3) already gives p(yes): that is the score.
"""

from __future__ import annotations

from llmrun.engine.llama import Context, LlamaError
from llmrun.engine.rerank import Reranker, fill, score
from llmrun.engine.sidework import Read
from llmrun.request import ChatRequest


class CrossEncoder(Reranker):
    name = "llmrun-crossencoder"
    embeddings = True  # rank pooling: the head's outputs per sequence
    last_only = False  # pooling reads every token's output

    def prompt(self, req: ChatRequest, query: str, document: str) -> list[int]:
        template = self.model.chat_template("rerank")
        if template is not None:
            # only {query} and {document}, as llama-server fills it
            text = fill(template, {"query": query, "document": document,
                                   "instruction": "{instruction}"})
            return self.model.tokenize(text, add_special=False, parse_special=True)
        return self.model.pair_tokens(
            self.model.tokenize(query, add_special=False, parse_special=False),
            self.model.tokenize(document, add_special=False, parse_special=False))

    def reader(self, req: ChatRequest) -> Read:
        if self.model.rank_softmax:
            def probability(ctx: Context, seq: int, row: int) -> float:
                return float(ctx.embedding(seq)[0])
            return probability
        if self.model.n_cls_out != 1:
            raise LlamaError(f"this cross-encoder's head has {self.model.n_cls_out} outputs; "
                             "llmrun scores with one-label heads (a relevance logit)")

        def logit(ctx: Context, seq: int, row: int) -> float:
            return score(float(ctx.embedding(seq)[0]), 0.0)  # sigmoid(x) = score(x, 0)
        return logit
