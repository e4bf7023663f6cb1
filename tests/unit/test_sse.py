"""SSE framing: whole events out however the bytes were split, byte for byte."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.sse import EventFramer, event_data

STREAM = (b'data: {"a": 1}\n\n: keep-alive\n\ndata: line1\ndata: line2\r\n\r\n'
          b'event: x\ndata:nospace\n\ndata: [DONE]\n\n')
EVENTS = [b'data: {"a": 1}\n\n', b": keep-alive\n\n", b"data: line1\ndata: line2\r\n\r\n",
          b"event: x\ndata:nospace\n\n", b"data: [DONE]\n\n"]


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_chunking_gives_the_same_events(cuts):
    framer = EventFramer()
    bounds = [0, *sorted(cuts), len(STREAM)]
    events = [e for a, b in zip(bounds, bounds[1:]) for e in framer.feed(STREAM[a:b])]
    assert events == EVENTS
    assert framer.pending == b""


def test_unfinished_event_stays_pending():
    framer = EventFramer()
    assert framer.feed(b"data: partial\n") == []
    assert framer.pending == b"data: partial\n"


def test_event_data_fields():
    assert [event_data(e) for e in EVENTS] == [b'{"a": 1}', None, b"line1\nline2", b"nospace", b"[DONE]"]
