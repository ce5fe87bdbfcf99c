"""The SSE decoder (sse.py) against its spec, whatever the reads: every split of a stream
into reads gives the events of the whole stream at once, for LF, CR and CRLF line ends,
comments, multi-line events and `event:` fields; an event over the bound is a fault however
it arrives. The decoder holds an unterminated event's reads as they came and joins them
once, at the read that may end it: these cases pin that no end is missed at a read's edge."""

from __future__ import annotations

import itertools
import random

import pytest

from tokenpipe import sse

STREAMS = {
    "lf": b'data: {"a":1}\n\ndata: {"b":2}\n\n: ping\n\ndata: [DONE]\n\n',
    "crlf": b'data: {"a":1}\r\n\r\ndata: x\r\ndata: y\r\n\r\n: c\r\n\r\n',
    "cr": b"data: one\r\rdata: two\rdata: three\r\r",
    "mixed": b"data: a\r\n\ndata: b\n\r\ndata: c\r\rdata: d\n\revent: e\ndata: f\r\n\r\n",
    "fields": b"event: message_start\ndata: {}\nid: 7\nretry: 1\n\n:\n\ndata:\n\ndata: z\n\n",
    "unterminated": b"data: whole\n\ndata: not yet ended\r",
    "line-end-pairs": b"data: z\n\r\n\rdata: y\r\n\r\r\n:x\n\r\r\n\n\r\rdata: q\r\n\n",
}


def _events(reads: list[bytes]) -> tuple[list[sse.Event], bool]:
    """The events, and whether an unterminated one is left (its bytes are held as they came,
    so their line ends may or may not be normalised yet)."""
    d = sse.SSEDecoder()
    out: list[sse.Event] = []
    for r in reads:
        out += d.feed(r)
    return out, bool(d.pending)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("name", list(STREAMS))
def test_every_split_gives_the_events_of_the_whole(name: str) -> None:
    data = STREAMS[name]
    whole = _events([data])
    assert whole[0], "the stream has events"
    assert _events([data[i : i + 1] for i in range(len(data))]) == whole  # byte by byte
    n = len(data)
    for i in range(n + 1):  # every split in three (two reads at every pair of places)
        for j in range(i, n + 1):
            assert _events([data[:i], data[i:j], data[j:]]) == whole, (i, j)
    rng = random.Random(name)
    for _ in range(300):  # random splits, empty reads among them
        cuts = [rng.randrange(len(data) + 1) for _ in range(rng.randrange(1, 8))]
        assert _events(_split(data, cuts)) == whole, cuts


def test_the_events_are_what_the_spec_says() -> None:
    events, pending = _events([STREAMS["mixed"]])
    assert [(e.data, e.event) for e in events] == [
        (b"a", None),
        (b"b", None),
        (b"c", None),
        (b"d", None),
        (b"f", "e"),
    ]
    assert not pending
    d = sse.SSEDecoder()
    d.feed(STREAMS["unterminated"])
    assert d.pending == b"data: not yet ended\r"


@pytest.mark.parametrize("read", [1, 1000, 1 << 16])
def test_an_event_over_the_bound_is_a_fault_however_it_arrives(read: int) -> None:
    d = sse.SSEDecoder(max_event_bytes=100_000)
    data = b"data: ok\n\ndata: " + b"a" * 100_000
    got: list[sse.Event] = []
    for i in range(0, len(data), read):
        got += d.feed(data[i : i + read])
        if d.fault is not None:
            break
    assert [e.data for e in got] == [b"ok"]  # the events before it, then the fault
    assert d.fault is not None and d.pending == b""
    with pytest.raises(sse.SSEProtocolError, match="larger than 100000 bytes"):
        d.feed(b"\n\n")


def test_a_long_event_in_small_reads_is_whole() -> None:
    data = b"data: " + b"x" * 300_000 + b"\r\n\r\ndata: next\n\n"
    events, pending = _events([data[i : i + 999] for i in range(0, len(data), 999)])
    assert [len(e.data) for e in events] == [300_000, 4] and not pending


@pytest.mark.parametrize("name", list(STREAMS))
def test_a_long_event_s_end_is_found_at_every_read_edge(name: str) -> None:
    """Past 64 KiB held, the end of an event is searched for only after what was held (sse.py):
    a long event then each stream, its last read cut at every place around the end, and
    random splits, give the events of the whole."""
    long = b"event: big\ndata: " + b"x" * 70_000 + b"\n\n"
    data = long + STREAMS[name]
    whole = _events([data])
    assert whole[0][0].data == b"x" * 70_000 and whole[0][0].event == "big"
    head = len(long) - 40  # every read edge within the long event's last 40 bytes and after
    for i in range(head, min(len(data), len(long) + 24) + 1):
        assert _events([data[:head], data[head:i], data[i:]]) == whole, i
        assert _events([data[:i], data[i:]]) == whole, i
    rng = random.Random(name)
    for _ in range(100):
        cuts = [rng.randrange(len(data) + 1) for _ in range(rng.randrange(1, 40))]
        assert _events(_split(data, cuts)) == whole, cuts


#: Events a read may hold, each as its bytes: the one-line `data:` events `feed_many` takes,
#: and those it must leave to `feed` (another field, a comment, a second line, `data: `
#: alone, no space after the colon, CR line ends, a separator inside a data line's text).
_PLAIN = [b'data: {"a":1}\n\n', b"data: [DONE]\n\n", b"data:  two spaces\n\n", b"data: x\n\n"]
_OTHER = [
    b"event: e\ndata: {}\n\n",
    b": ping\n\n",
    b"data: a\ndata: b\n\n",
    b"data: \n\n",
    b"data:nospace\n\n",
    b"data: cr\r\n\r\n",
    b"data: a\r\rdata: b\n\n",
    b"id: 7\n\n",
]


def test_a_read_of_whole_data_events_is_split_as_feed_splits_it() -> None:
    """`feed_many` gives exactly what `feed` gives for a read of one-line data events, and
    declines (None) every read holding anything else, wherever that is: the fast path never
    changes what a stream means."""
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(1, 5)
        events = [rng.choice(_PLAIN if rng.random() < 0.8 else _OTHER) for _ in range(n)]
        read = b"".join(events)
        many = sse.SSEDecoder().feed_many(read)
        if all(e in _PLAIN for e in events):
            assert many == [e.data for e in sse.SSEDecoder().feed(read)], read
        else:
            assert many is None, read


def test_a_read_after_held_bytes_or_unterminated_is_left_to_feed() -> None:
    d = sse.SSEDecoder()
    assert d.feed(b"data: par") == []
    assert d.feed_many(b'data: {"a":1}\n\n') is None  # held bytes come first
    assert sse.SSEDecoder().feed_many(b"data: a\n\ndata: b\n") is None  # the last not ended
    assert sse.SSEDecoder().feed_many(b"data: a\n\ndata: b") is None


_NAMED = [
    b'event: response.output_text.delta\ndata: {"delta":"x"}\n\n',
    b"event: ping\ndata: {}\n\n",
    b"event: \ndata: [x]\n\n",  # an empty name, as `feed` reads it
    b"event:  spaced\ndata:  two\n\n",
]
_NOT_NAMED = [
    b"event: a\ndata: {}\nid: 1\n\n",
    b"event: a\nid: 1\ndata: {}\n\n",
    b"data: {}\nevent: a\n\n",
    b"event: a\ndata: \n\n",
    b"event: a\n\n",
    b"event: a\ndata:x\n\n",
    b"event: a\r\ndata: {}\r\n\r\n",
    b"event: a\ndata: 1\ndata: 2\n\n",
    b": ping\n\n",
    b'data: {"a":1}\n\n',
]


def test_a_read_of_whole_named_events_is_split_as_feed_splits_it() -> None:
    """`feed_named` gives exactly `feed`'s events for a read of `event:` + `data:` pairs, and
    declines every read with anything else in it, wherever that is."""
    rng = random.Random(11)
    for _ in range(3000):
        n = rng.randint(1, 5)
        events = [rng.choice(_NAMED if rng.random() < 0.8 else _NOT_NAMED) for _ in range(n)]
        read = b"".join(events)
        named = sse.SSEDecoder().feed_named(read)
        if all(e in _NAMED for e in events):
            assert named == sse.SSEDecoder().feed(read), read
        else:
            assert named is None, read
    d = sse.SSEDecoder()
    assert d.feed(b"event: a\ndata: par") == []
    assert d.feed_named(b"event: b\ndata: {}\n\n") is None  # held bytes come first
