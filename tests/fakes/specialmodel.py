"""Tiny models whose vocabulary holds the chat families' markers as special tokens, as the
real models' vocabularies do (gpt-oss's `<|channel|>` ... `<|call|>`, DeepSeek's
`<｜tool▁calls▁begin｜>` ..., Kimi K2's `<|tool_calls_section_begin|>` ...), each with its
family's real chat template (tests/fakes/templates/) in its metadata.

The weights are tests/fakes/tinymodel.py's random ones: what such a model writes is forced
with a grammar; what matters here is its vocabulary. Every family's markers are in one
vocabulary, as control tokens (gguf TokenType.CONTROL), so their ids are the same in each
family's model. llama.cpp changes some on load, as it does for gpt-oss's own vocabulary:
`<|channel|>`, `<|message|>`, `<|start|>`, `<|constrain|>` and `<|end|>` become user-defined
tokens (always rendered as text, never end generation), `<|call|>` and `<|return|>` stay
control tokens that end generation, as do `<|im_end|>` and `<｜end▁of▁sentence｜>`.

    from tests.fakes.specialmodel import write_special_model, token_id
    path = write_special_model(tmp_path / "harmony.gguf", "harmony")
"""

from __future__ import annotations

from pathlib import Path

from tests.fakes.tinymodel import write_tiny_llama

TEMPLATES = Path(__file__).parent / "templates"
FAMILY_TEMPLATES = {"harmony": "openai-gpt-oss-120b.jinja",
                    "deepseek-v3.1": "deepseek-ai-DeepSeek-V3.1.jinja",
                    "kimi-k2": "moonshotai-Kimi-K2.jinja"}

# Each family's markers and the role markers its template writes: control tokens all
SPECIALS: tuple[str, ...] = (
    # gpt-oss (harmony)
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
    "<|constrain|>",
    # DeepSeek V3.1
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    # Kimi K2
    "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
)
FIRST_ID = 3  # after <unk>, <s>, </s> (tinymodel.vocabulary)
# Long prompts: harmony's system preamble alone is some 300 tokens of this small vocabulary
N_CTX = 4096


def token_id(marker: str) -> int:
    """The id of `marker`'s special token in these models' vocabulary."""
    return FIRST_ID + SPECIALS.index(marker)


def template(family: str) -> str:
    return (TEMPLATES / FAMILY_TEMPLATES[family]).read_text()


# The token each family's model writes wherever it may: the end of a thought. Random weights
# would write a thought (free text, before any grammar applies) until the token limit.
FAVOURED = {"harmony": "<|end|>", "deepseek-v3.1": "</think>"}


def write_special_model(path: Path, family: str) -> Path:
    """A tiny model of `family` (a key of FAMILY_TEMPLATES) at `path`, ending its thoughts
    as soon as it may (FAVOURED)."""
    favour = token_id(FAVOURED[family]) if family in FAVOURED else None
    return write_tiny_llama(path, specials=SPECIALS, chat_template=template(family),
                            n_ctx=N_CTX, favour=favour)
