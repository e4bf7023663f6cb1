"""SSE framing: whole events out however the bytes were split and whichever line endings the upstream uses,
byte for byte, in time linear in the stream."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.streaming.sse import EventFramer, EventTooLarge, MalformedEvent, event_data, read_event

# Every blank-line form the SSE specification allows: each line may end in CRLF, LF or CR, mixed within an event.
EVENTS = [
    b'data: {"a": 1}\n\n',
    b": keep-alive\n\n",
    b"data: line1\ndata: line2\r\n\r\n",
    b"event: x\ndata:nospace\n\n",
    b"data: cr\r\r",
    b"data: crlf-then-cr\r\n\r",
    b"data: lf-crlf\n\r\n",
    b"data: crlf-lf\r\n\n",
    b"data: cr-crlf\r\r\n",
    b"data: lf-cr\n\r",
    b"data: a\rdata: b\r\r",
    b"data: [DONE]\r\n\r\n",
]
DATA = [
    b'{"a": 1}',
    None,
    b"line1\nline2",
    b"nospace",
    b"cr",
    b"crlf-then-cr",
    b"lf-crlf",
    b"crlf-lf",
    b"cr-crlf",
    b"lf-cr",
    b"a\nb",
    b"[DONE]",
]
STREAM = b"".join(EVENTS)


def frame(chunks: list[bytes], max_event_bytes: int | None = None) -> tuple[list[bytes], EventFramer]:
    framer = EventFramer(max_event_bytes)
    return [event for chunk in chunks for event in framer.feed(chunk)], framer


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=16))
def test_any_chunking_gives_the_same_events(cuts):
    bounds = [0, *sorted(cuts), len(STREAM)]
    events, framer = frame([STREAM[a:b] for a, b in zip(bounds, bounds[1:])])
    assert [event_data(e) for e in events] == DATA
    assert b"".join(events) + framer.pending == STREAM  # relayed byte for byte
    assert framer.pending in (b"", b"\n")  # at most the LF of a CRLF that ended the last event


def test_unsplit_stream_gives_each_event_whole():
    events, _ = frame([STREAM])
    assert events == EVENTS


def test_crlf_split_across_chunks_is_one_line_end():
    framer = EventFramer()
    assert framer.feed(b"data: a\r") == []  # a CR at a chunk end: a line ended, not yet an event
    assert framer.feed(b"\ndata: b\r\n\r\n") == [b"data: a\r\ndata: b\r\n\r\n"]


def test_cr_at_chunk_end_followed_by_another_line_end_ends_the_event():
    framer = EventFramer()
    assert framer.feed(b"data: a\r") == []
    assert framer.feed(b"\r") == [b"data: a\r\r"]


def test_event_ending_in_a_cr_goes_out_before_the_next_byte_arrives():
    framer = EventFramer()
    assert framer.feed(b"data: a\r\n\r") == [b"data: a\r\n\r"]  # complete: not held back for a possible LF
    events = framer.feed(b"\ndata: b\r\n\r\n")  # that LF belonged to the CR: it makes no blank line of its own
    assert [event_data(e) for e in events] == [b"b"]


def test_unfinished_event_stays_pending():
    framer = EventFramer()
    assert framer.feed(b"data: partial\n") == []
    assert framer.pending == b"data: partial\n"


def test_event_data_fields():
    assert [event_data(e) for e in EVENTS] == DATA


@pytest.mark.parametrize(
    "chunks",
    [
        [b"data: " + b"x" * 600],  # an unfinished event past the limit
        [b"data: " + b"x" * 600 + b"\n\n"],  # a finished one
        [b"data: ok\n\n", b"data: " + b"x" * 300, b"x" * 300],  # one that grows past it chunk by chunk
    ],
)
def test_an_event_above_the_limit_is_refused(chunks):
    with pytest.raises(EventTooLarge):
        frame(chunks, max_event_bytes=512)


def test_events_within_the_limit_pass():
    events, _ = frame([b"data: " + b"x" * 500 + b"\n\n"] * 3, max_event_bytes=512)
    assert len(events) == 3


@pytest.mark.parametrize("piece", [b"x" * 1024, b"data: x\n" * 128, b"x" * 1022 + b"\r\n"])
def test_framing_time_is_linear_in_the_stream(piece):
    """16 MiB in 1 KiB chunks with no event boundary: rescanning the pending bytes on every chunk would cost
    16384 scans of ~8 MiB each (minutes); one pass costs well under a second."""
    framer = EventFramer()
    started = time.perf_counter()
    for _ in range(16 * 1024):
        assert framer.feed(piece) == []
    elapsed = time.perf_counter() - started
    assert len(framer.pending) == 16 * 1024 * 1024
    assert elapsed < 5.0, f"framing 16 MiB took {elapsed:.1f} s"


BOM = b"\xef\xbb\xbf"


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM) + len(BOM)), max_size=16))
def test_a_byte_order_mark_that_starts_the_stream_is_no_part_of_its_first_event(cuts):
    """The SSE specification has a stream's one leading BOM ignored: with it kept, the first event's first line
    would not read as its `data` field (its data lost), however the BOM's three bytes were split."""
    stream = BOM + STREAM
    bounds = [0, *sorted(cuts), len(stream)]
    events, framer = frame([stream[a:b] for a, b in zip(bounds, bounds[1:])])
    assert [event_data(e) for e in events] == DATA
    assert b"".join(events) + framer.pending == STREAM


def test_only_a_leading_byte_order_mark_is_dropped():
    events, _ = frame([b"\xef\xbb", b"\xbfdata: a\n\n" + BOM + b"data: b\n\n"])
    assert events == [b"data: a\n\n", BOM + b"data: b\n\n"]  # later on, U+FEFF is the event's own byte
    events, _ = frame([b"\xef", b"\xbbdata: x\n\n"])  # not a whole BOM: the stream's own bytes, as sent
    assert events == [b"\xef\xbbdata: x\n\n"]


def test_read_event_reads_the_data_event_data_reads_and_the_events_type():
    assert [read_event(e)[1] for e in EVENTS] == DATA
    assert read_event(b"event: x\ndata:nospace\n\n") == (b"x", b"nospace")
    assert read_event(b"id: 7\nretry: 100\nevent: ping\n\n") == (b"ping", None)
    assert read_event(b"\n") == (None, None)  # the LF of a CRLF cut across chunks leads the next event


@pytest.mark.parametrize(
    "event",
    [
        b"\x00\x01\xfe\xff garbage\n\n",  # binary: a line of no field
        b"dta: {}\n\n",  # a field the specification does not define (a client skips it)
        b"data: ok\nnot a field\n\n",  # a field name without its colon
        b"data\n\n",  # the same, for a field the specification defines: never sent, and read otherwise
        b": \xff\xfe\n\n",  # a comment that is not UTF-8
        b"event: \xff\ndata: {}\n\n",  # a type that is not UTF-8
    ],
)
def test_read_event_refuses_what_is_not_sse(event):
    with pytest.raises(MalformedEvent):
        read_event(event)
