"""JSON text as a client's parser reads it, as it streams: escapes decoded like `json.loads`, whatever pieces they
arrive in, with the way back to whole escape sequences of the raw text."""

from __future__ import annotations

import json

import pytest

from gateway.apis.decoded_json import DecodedJson

VALUE = {"key": 'AKIA \u00e9t\u00e9 \U0001f600 "q" \\ /\n\t', "n": [1, "x"]}
READ = '{"key": "AKIA \u00e9t\u00e9 \U0001f600 "q" \\ /\n\t", "n": [1, "x"]}'  # each escape, the character it is


def decoded(pieces: list[str]) -> DecodedJson:
    text = DecodedJson()
    for piece in pieces:
        text.append(piece)
    text.finish()
    return text


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 1000])
def test_strings_decode_as_json_loads_reads_them_in_any_pieces(size: int) -> None:
    raw = json.dumps(VALUE)  # every non-ASCII character escaped, a surrogate pair for the emoji
    assert "\\ud83d\\ude00" in raw
    text = decoded([raw[i : i + size] for i in range(0, len(raw), size)])
    assert str(text.text) == READ
    assert text.consumed == len(raw)


def test_an_escape_still_arriving_is_not_consumed() -> None:
    text = DecodedJson()
    text.append('{"k": "ab\\u00')
    assert str(text.text) == '{"k": "ab' and text.consumed == len('{"k": "ab')
    text.append("41")
    assert str(text.text) == '{"k": "abA'
    text.append("\\ud83d")  # half a surrogate pair: its other half may follow
    assert str(text.text) == '{"k": "abA'
    text.append('\\ude00"}')
    assert str(text.text) == '{"k": "abA\U0001f600"}'


def test_a_decoded_stretch_maps_back_to_whole_escapes_inside_one_string() -> None:
    raw = '{"a": "x\\u0041KIA", "b": 1}'
    text = decoded([raw])
    start = str(text.text).index("AKIA")
    end = start + 4
    assert raw[text.raw_offset(start) : text.raw_offset(end)] == "\\u0041KIA"
    assert text.in_one_string(start, end)
    quote = str(text.text).index('", "b"')
    assert not text.in_one_string(start, quote + 2), "it crosses a string's closing quote"
    assert not text.in_one_string(str(text.text).index("1"), str(text.text).index("1") + 1), "a number"
