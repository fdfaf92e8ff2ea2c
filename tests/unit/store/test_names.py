"""llmrun.store.names.parse: model names and the rules that keep them safe as paths."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from llmrun.store.names import InvalidName, ModelName, parse


def test_plain_name_gets_latest_tag() -> None:
    n = parse("llama3")
    assert n == ModelName(host="", namespace="library", model="llama3", tag="latest")
    assert not n.is_hf
    assert str(n) == "llama3:latest"
    assert n.short == "llama3"


def test_name_with_tag() -> None:
    n = parse("qwen2.5:0.5b-instruct")
    assert n == ModelName("", "library", "qwen2.5", "0.5b-instruct")
    assert str(n) == "qwen2.5:0.5b-instruct"
    assert n.short == "qwen2.5:0.5b-instruct"


def test_namespace_name_tag() -> None:
    n = parse("me/my-model:v1")
    assert n == ModelName("", "me", "my-model", "v1")
    assert str(n) == "me/my-model:v1"
    assert n.short == "me/my-model:v1"


def test_namespace_without_tag_short_drops_latest() -> None:
    n = parse("me/my-model")
    assert str(n) == "me/my-model:latest"
    assert n.short == "me/my-model"


def test_library_namespace_is_the_plain_name() -> None:
    assert parse("library/x") == parse("x")
    assert str(parse("library/x")) == "x:latest"


def test_names_are_lower_cased_and_stripped() -> None:
    n = parse("  MyModel:Q8_0 ")
    assert n == ModelName("", "library", "mymodel", "q8_0")


def test_hf_name() -> None:
    n = parse("hf.co/Org/Repo-GGUF:Q4_K_M")
    # the Hub's repo ids are case-sensitive: the repo keeps its case, the quant tag does not
    assert n == ModelName(host="hf.co", namespace="Org", model="Repo-GGUF", tag="q4_k_m")
    assert n.is_hf
    assert str(n) == "hf.co/Org/Repo-GGUF:q4_k_m"
    assert n.short == "hf.co/Org/Repo-GGUF:q4_k_m"
    # ... but names match case-insensitively in the store
    assert n.manifest_path() == parse("hf.co/org/repo-gguf:q4_k_m").manifest_path()


def test_huggingface_co_maps_to_hf_co() -> None:
    n = parse("HuggingFace.co/bartowski/SmolLM2-GGUF")
    assert n == ModelName("hf.co", "bartowski", "SmolLM2-GGUF", "latest")
    assert str(n) == "hf.co/bartowski/SmolLM2-GGUF:latest"
    assert n.short == "hf.co/bartowski/SmolLM2-GGUF"


def test_url_scheme_is_dropped() -> None:
    assert parse("https://hf.co/org/repo:q4_0") == ModelName("hf.co", "org", "repo", "q4_0")


@pytest.mark.parametrize(
    "text",
    ["x", "x:latest", "ns/x:v1.2", "hf.co/org/repo:q4_k_m", "hf.co/org/repo", "a_b:_t"],
)
def test_str_and_short_round_trip(text: str) -> None:
    n = parse(text)
    assert parse(str(n)) == n
    assert parse(n.short) == n


def test_manifest_path() -> None:
    assert parse("x").manifest_path() == PurePosixPath("local/library/x/latest")
    assert parse("ns/m:t").manifest_path() == PurePosixPath("local/ns/m/t")
    assert parse("hf.co/org/repo:q4_k_m").manifest_path() == PurePosixPath(
        "hf.co/org/repo/q4_k_m"
    )


def test_hf_name_needs_org_and_repo() -> None:
    with pytest.raises(InvalidName, match=r"hf\.co/\{org\}/\{repo\}"):
        parse("hf.co/justrepo")
    with pytest.raises(InvalidName, match=r"hf\.co/\{org\}/\{repo\}"):
        parse("hf.co/a/b/c")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "model name is empty"),
        ("   ", "model name is empty"),
        (":tag", "model name is empty"),
        ("x:", "tag is empty"),
        ("/x", "namespace is empty"),
        ("a..b", "model name 'a..b' must not contain '..'"),
        ("../x", "namespace '..' must not contain '..'"),
        ("x:..", "tag '..' must not contain '..'"),
        ("a\\b", "model name 'a\\\\b' must not contain a path separator"),
        ("x:a\\b", "tag 'a\\\\b' must not contain a path separator"),
        ("a/b/c", "model name 'a/b/c' has too many '/' components"),
        ("/etc/passwd", "model name '/etc/passwd' has too many '/' components"),
    ],
)
def test_refusals_name_the_rule(text: str, message: str) -> None:
    with pytest.raises(InvalidName) as exc:
        parse(text)
    assert str(exc.value) == message


def test_component_too_long() -> None:
    parse("a" * 80)  # the limit itself is fine
    with pytest.raises(InvalidName) as exc:
        parse("a" * 81)
    assert str(exc.value) == f"model name {'a' * 81!r} is longer than 80 characters"
    with pytest.raises(InvalidName, match=r"namespace 'b+' is longer than 80 characters"):
        parse("b" * 81 + "/x")


def test_tag_too_long() -> None:
    parse("x:" + "t" * 128)
    with pytest.raises(InvalidName) as exc:
        parse("x:" + "t" * 129)
    assert str(exc.value) == f"tag {'t' * 129!r} is longer than 128 characters"


def test_whole_name_too_long() -> None:
    with pytest.raises(InvalidName) as exc:
        parse("a" * 351)
    assert str(exc.value) == "model name is longer than 350 characters"


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("a b", "model name 'a b'"),
        ("x$", "model name 'x$'"),
        ("x:t@g", "tag 't@g'"),
        ("-x", "model name '-x'"),
        (".x", "model name '.x'"),
        ("_x", "model name '_x'"),
        ("-ns/x", "namespace '-ns'"),
        ("x:-t", "tag '-t'"),
        ("x:.t", "tag '.t'"),
    ],
)
def test_bad_characters_and_leading_punctuation(text: str, what: str) -> None:
    with pytest.raises(InvalidName) as exc:
        parse(text)
    assert str(exc.value) == (
        f"{what} may only use letters, digits, '.', '_' and '-', "
        "and must start with a letter or digit"
    )


def test_tag_may_start_with_underscore() -> None:
    assert parse("x:_t").tag == "_t"


@pytest.mark.parametrize("text", ["x\n:tag", "ns\n/x", "hf.co/org\n/repo"])
def test_newline_inside_a_name_is_refused(text: str) -> None:
    with pytest.raises(InvalidName):
        parse(text)
