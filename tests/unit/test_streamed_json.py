"""Whether streamed JSON text is whole yet, followed piece by piece, against a parse of the text so far."""

from __future__ import annotations

import json
import time

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.apis.streamed_json import StreamedJson

# JSON values whose strings hold what trips a naive reader: quotes, backslashes, brackets, escapes
TRICKY = st.text(alphabet=st.sampled_from(list('ab {}[]"\\\n/u:,é😀')), max_size=12)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | TRICKY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
    max_leaves=12,
)


def parses(text: str) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(
    value=st.dictionaries(TRICKY, VALUES, max_size=4),
    ascii_only=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_whole_exactly_when_the_text_so_far_parses(value, ascii_only, cuts) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    streamed = StreamedJson()
    for start, end in zip(bounds, bounds[1:]):
        streamed.append(text[start:end])
        assert streamed.whole() == parses(text[:end]), text[:end]


def test_a_second_value_after_the_first_is_never_whole() -> None:
    streamed = StreamedJson()
    for piece in ['{"a": 1}', "{", '"b": 2}']:
        streamed.append(piece)
    assert not streamed.whole()


def test_megabytes_of_code_in_a_string_cost_no_parse_per_fragment() -> None:
    """Fragments of code inside a string end in `}` all the time: none closes the value, so none is parsed."""
    streamed = StreamedJson()
    streamed.append('{"code": "')
    started = time.perf_counter()
    for _ in range(50_000):
        streamed.append("if (x) { y(); }")
        assert not streamed.whole()
    assert time.perf_counter() - started < 5  # parsing all of it per fragment took minutes
    streamed.append('"}')
    assert streamed.whole()
