"""llmrun.store.modelfile: parsing Ollama's Modelfile syntax, rendering it back, errors by line."""

from __future__ import annotations

import pytest

from llmrun.request import Message
from llmrun.store.modelfile import Modelfile, ModelfileError, parse


def test_from_only() -> None:
    assert parse("FROM llama3\n") == Modelfile(from_="llama3")


def test_parameters_of_each_type() -> None:
    mf = parse(
        "FROM ./model.gguf\n"
        "PARAMETER num_ctx 4096\n"
        "PARAMETER temperature 0.7\n"
        "PARAMETER top_p 1\n"
        "PARAMETER use_mmap false\n"
        "PARAMETER seed -1\n"
    )
    assert mf.from_ == "./model.gguf"
    assert mf.parameters == {
        "num_ctx": 4096,
        "temperature": 0.7,
        "top_p": 1.0,
        "use_mmap": False,
        "seed": -1,
    }
    assert type(mf.parameters["num_ctx"]) is int
    assert type(mf.parameters["top_p"]) is float
    assert mf.parameters["use_mmap"] is False
    assert mf.options().num_ctx == 4096


def test_bool_parameter_is_case_insensitive() -> None:
    assert parse("FROM x\nPARAMETER use_mmap TRUE\n").parameters == {"use_mmap": True}


def test_stop_lines_accumulate() -> None:
    mf = parse(
        "FROM x\n"
        "PARAMETER stop <|im_end|>\n"
        'PARAMETER stop "User:"\n'
        "PARAMETER stop </s>\n"
    )
    assert mf.parameters == {"stop": ["<|im_end|>", "User:", "</s>"]}


def test_multi_line_template_and_system() -> None:
    text = (
        "FROM x\n"
        'TEMPLATE """{{ if .System }}<|system|>\n'
        "{{ .System }}\n"
        '{{ end }}"""\n'
        'SYSTEM """You are\n'
        "  a helpful\n"
        'assistant."""\n'
        "PARAMETER top_k 20\n"
    )
    mf = parse(text)
    assert mf.template == "{{ if .System }}<|system|>\n{{ .System }}\n{{ end }}"
    assert mf.system == "You are\n  a helpful\nassistant."
    assert mf.parameters == {"top_k": 20}


def test_multi_line_block_opening_on_its_own() -> None:
    mf = parse('FROM x\nSYSTEM """\nline one\nline two\n"""\n')
    assert mf.system == "\nline one\nline two\n"


def test_single_line_triple_quoted() -> None:
    mf = parse('FROM x\nSYSTEM """Be brief."""\nTEMPLATE """{{ .Prompt }}"""\n')
    assert mf.system == "Be brief."
    assert mf.template == "{{ .Prompt }}"


def test_quoted_and_bare_values() -> None:
    mf = parse('FROM "./my model.gguf"\nSYSTEM "Be # brief."\nLICENSE MIT\n')
    assert mf.from_ == "./my model.gguf"
    assert mf.system == "Be # brief."
    assert mf.license == ["MIT"]


def test_comments_blank_lines_and_case_insensitive_instructions() -> None:
    text = (
        "# a comment\n"
        "\n"
        "   # an indented comment\n"
        "from llama3\n"
        "\n"
        "Parameter Temperature 0.2\n"
        "system hello\n"
        "aDaPtEr ./lora.gguf\n"
    )
    mf = parse(text)
    assert mf == Modelfile(
        from_="llama3",
        parameters={"temperature": 0.2},
        system="hello",
        adapters=["./lora.gguf"],
    )


def test_tab_after_instruction() -> None:
    mf = parse("FROM\tllama3\nPARAMETER\ttop_k 5\n")
    assert mf.from_ == "llama3"
    assert mf.parameters == {"top_k": 5}


def test_messages() -> None:
    mf = parse(
        "FROM x\n"
        "MESSAGE user Is the sky blue?\n"
        'MESSAGE Assistant "Yes."\n'
        'MESSAGE system """Line 1\n'
        'Line 2"""\n'
    )
    assert mf.messages == [
        Message(role="user", content="Is the sky blue?"),
        Message(role="assistant", content="Yes."),
        Message(role="system", content="Line 1\nLine 2"),
    ]


def test_render_then_parse_round_trips() -> None:
    mf = Modelfile(
        from_="hf.co/org/repo:q4_k_m",
        parameters={
            "num_ctx": 8192,
            "temperature": 0.25,
            "use_mmap": True,
            "stop": ["<|im_end|>", "a # b", 'say "hi" now'],
        },
        template="{% for m in messages %}\n{{ m.content }}\n{% endfor %}",
        system="You are\na pirate.",
        messages=[
            Message(role="user", content="Ahoy?"),
            Message(role="assistant", content="Arr,\nmatey."),
        ],
        license=["MIT License\n\nCopyright ..."],
        adapters=["./lora.gguf"],
    )
    text = mf.render()
    assert text.startswith("FROM hf.co/org/repo:q4_k_m\nADAPTER ./lora.gguf\n")
    assert 'PARAMETER stop """a # b"""\n' in text
    assert parse(text) == mf


def test_render_of_minimal_modelfile() -> None:
    mf = Modelfile(from_="x")
    assert mf.render() == "FROM x\n"
    assert parse(mf.render()) == mf


@pytest.mark.parametrize("stop", ["\n", " User:", "\n\n"])
def test_whitespace_stop_round_trips(stop: str) -> None:
    mf = Modelfile(from_="x", parameters={"stop": [stop]})
    assert parse(mf.render()) == mf


def _error(text: str) -> ModelfileError:
    with pytest.raises(ModelfileError) as exc:
        parse(text)
    return exc.value


def test_unknown_instruction() -> None:
    err = _error("FROM x\n\nFOO bar\n")
    assert err.line == 3
    assert str(err) == "Modelfile line 3: unknown instruction 'FOO'"


def test_unknown_parameter() -> None:
    err = _error("FROM x\nPARAMETER top_k 3\nPARAMETER warmth 3\n")
    assert err.line == 3
    assert str(err) == "Modelfile line 3: unknown parameter 'warmth'"


def test_parameter_without_value() -> None:
    err = _error("FROM x\nPARAMETER top_k\n")
    assert err.line == 2
    assert str(err) == "Modelfile line 2: parameter 'top_k' needs a value"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("PARAMETER temperature hot", "invalid value 'hot' for parameter temperature"),
        ("PARAMETER num_ctx 4096.5", "invalid value '4096.5' for parameter num_ctx"),
        ("PARAMETER use_mmap yes", "invalid value 'yes' for parameter use_mmap"),
        ("PARAMETER top_p 2", "invalid value '2' for parameter top_p"),
        ("PARAMETER temperature -0.1", "invalid value '-0.1' for parameter temperature"),
        ("PARAMETER num_ctx 0", "invalid value '0' for parameter num_ctx"),
    ],
)
def test_bad_parameter_values(line: str, message: str) -> None:
    err = _error(f"# header\nFROM x\n{line}\n")
    assert err.line == 3
    assert str(err) == f"Modelfile line 3: {message}"


def test_unterminated_triple_quote_names_the_opening_line() -> None:
    err = _error('FROM x\nPARAMETER top_k 1\nSYSTEM """never\nclosed\n')
    assert err.line == 3
    assert str(err) == 'Modelfile line 3: unterminated """ block'


def test_text_after_closing_triple_quote() -> None:
    err = _error('FROM x\nSYSTEM """a\nb""" junk\n')
    assert err.line == 3
    assert "unexpected text after closing" in str(err)
    err = _error('FROM x\nSYSTEM """a""" junk\n')
    assert err.line == 2


def test_missing_from() -> None:
    err = _error("PARAMETER top_k 1\nSYSTEM hi\n")
    assert err.line == 2
    assert str(err) == "Modelfile line 2: a Modelfile needs a FROM instruction"


def test_missing_from_in_empty_text() -> None:
    err = _error("")
    assert err.line == 1
    assert "needs a FROM instruction" in str(err)


def test_empty_from() -> None:
    err = _error("FROM\n")
    assert err.line == 1
    assert "FROM needs a model name or a path" in str(err)


def test_two_froms_are_a_model_and_its_projector() -> None:
    """As Ollama: a second FROM (a vision projector) parses; which FROM is the projector
    only the files' headers tell, so the store decides (tests/unit/store/test_store_vision.py)."""
    mf = parse("FROM a\nSYSTEM s\nFROM ./mmproj.gguf\n")
    assert (mf.from_, mf.extra_from, mf.froms) == ("a", ["./mmproj.gguf"], ["a", "./mmproj.gguf"])
    assert mf.render().startswith("FROM a\nFROM ./mmproj.gguf\n")
    assert parse(mf.render()) == mf


def test_three_froms() -> None:
    err = _error("FROM a\nSYSTEM s\nFROM b\nFROM c\n")
    assert err.line == 4
    assert str(err) == ("Modelfile line 4: at most two FROM lines: a model and its vision "
                        "projector (an mmproj GGUF)")


def test_bad_message_role() -> None:
    err = _error("FROM x\nMESSAGE tool hello\n")
    assert err.line == 2
    assert str(err) == "Modelfile line 2: MESSAGE role must be one of system, user, assistant"


def test_adapter_needs_a_path() -> None:
    err = _error("FROM x\nADAPTER\n")
    assert err.line == 2
    assert "ADAPTER needs a path" in str(err)
