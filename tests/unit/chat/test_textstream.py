"""llmrun.chat.textstream.TextStream: whole characters only, never part of a stop string."""

from __future__ import annotations

from llmrun.chat.textstream import TextStream


def _feed(stream: TextStream, pieces: list[bytes]) -> list[str]:
    return [stream.push(p) for p in pieces]


def test_plain_text_passes_through() -> None:
    s = TextStream([])
    assert _feed(s, [b"Hello", b", ", b"world"]) == ["Hello", ", ", "world"]
    assert s.flush() == ""
    assert not s.stopped


def test_multibyte_characters_split_across_pushes() -> None:
    euro = "€".encode()  # 3 bytes
    emoji = "😀".encode()  # 4 bytes
    s = TextStream([])
    out = _feed(s, [b"a" + euro[:1], euro[1:2], euro[2:] + emoji[:2], emoji[2:3], emoji[3:]])
    assert out == ["a", "", "€", "", "😀"]
    assert "".join(out) == "a€😀"


def test_multibyte_split_with_stops() -> None:
    data = "héllo wörld".encode()
    s = TextStream(["STOP"])
    out = _feed(s, [data[i : i + 1] for i in range(len(data))])
    assert all("\ufffd" not in piece for piece in out)
    assert "".join(out) + s.flush() == "héllo wörld"


def test_incomplete_character_at_the_end_is_replaced_on_flush() -> None:
    s = TextStream([])
    assert s.push(b"ok" + "€".encode()[:2]) == "ok"
    assert s.flush() == "\ufffd"


def test_stop_inside_a_token_cuts_before_it() -> None:
    s = TextStream(["</s>"])
    assert s.push(b"Hello") == "Hello"
    assert not s.stopped
    assert s.push(b" world</s>ignored") == " world"
    assert s.stopped
    assert s.flush() == ""


def test_stop_at_the_very_start() -> None:
    s = TextStream(["User:"])
    assert s.push(b"User: hi") == ""
    assert s.stopped


def test_stop_split_across_pushes_is_never_released() -> None:
    s = TextStream(["<|im_end|>"])
    pieces = [b"Sure", b". <", b"|im", b"_", b"end", b"|"]
    out = _feed(s, pieces)
    assert out == ["Sure", ". ", "", "", "", ""]
    assert not s.stopped
    out.append(s.push(b">"))
    assert out[-1] == ""
    assert s.stopped
    assert "".join(out) == "Sure. "


def test_stop_split_byte_by_byte() -> None:
    s = TextStream(["STOP"])
    out = []
    for b in b"abSTOP":
        assert not s.stopped
        out.append(s.push(bytes([b])))
    assert out == ["a", "b", "", "", "", ""]
    assert s.stopped
    assert s.flush() == ""


def test_held_partial_match_is_released_when_it_is_not_a_stop() -> None:
    s = TextStream(["</s>"])
    assert s.push(b"a <") == "a "
    assert s.push(b"/") == ""
    assert s.push(b"b") == "</b"
    assert not s.stopped
    assert s.push(b"</") == ""
    assert s.push(b"p>") == "</p>"
    assert not s.stopped


def test_flush_releases_the_held_remainder() -> None:
    s = TextStream(["\n\nUser:"])
    assert s.push(b"Done.\n") == "Done."
    assert s.push(b"\nUs") == ""
    assert s.flush() == "\n\nUs"
    assert not s.stopped
    assert s.flush() == ""


def test_earliest_of_several_stops_wins() -> None:
    s = TextStream(["END", "STOP", "x"])
    assert s.push(b"abcSTOPdefENDx") == "abc"
    assert s.stopped


def test_earliest_stop_wins_whatever_the_list_order() -> None:
    s = TextStream(["zz", "yy"])
    assert s.push(b"1yy2zz") == "1"
    s = TextStream(["yy", "zz"])
    assert s.push(b"1zz2yy") == "1"


def test_longest_partial_among_stops_is_held() -> None:
    s = TextStream(["ab", "xabc"])
    assert s.push(b"1xa") == "1"  # "xa" could begin "xabc"
    assert s.push(b"b") == "x"  # "ab" completed: what precedes it is released
    assert s.stopped


def test_empty_stop_strings_are_ignored() -> None:
    s = TextStream(["", "Q"])
    assert s.push(b"abc") == "abc"
    assert not s.stopped
