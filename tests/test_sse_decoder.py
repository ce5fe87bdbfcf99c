"""The SSE decoder (sse.py) against its spec, whatever the reads: every split of a stream
into reads gives the events of the whole stream at once, for LF, CR and CRLF line ends,
comments, multi-line events and `event:` fields; an event over the bound is a fault however
it arrives. The decoder holds an unterminated event's reads as they came and joins them
once, at the read that may end it: these cases pin that no end is missed at a read's edge."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from tokenpipe import sse
from tokenpipe.dialects.responses import TEXT_DELTA

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


def _datas(events: list[sse.Event]) -> list[bytes]:
    return [e.data for e in events]


def _named(events: list[sse.Event]) -> list[tuple[bytes, str | None, bytes]]:
    """Each event as `feed_named` gives it: its data, its name and its bytes as read."""
    return [
        (e.data, e.event, b"event: " + (e.event or "").encode() + b"\ndata: " + e.data + b"\n\n")
        for e in events
    ]


@pytest.mark.parametrize(
    ("fast", "taken", "left", "as_feed"),
    [("feed_many", _PLAIN, _OTHER, _datas), ("feed_named", _NAMED, _NOT_NAMED, _named)],
)
def test_a_read_split_at_once_is_what_feed_gives_or_is_left_to_it(
    fast: str, taken: list[bytes], left: list[bytes], as_feed: Any
) -> None:
    """`feed_many` (one-line data events) and `feed_named` (`event:` + `data:` pairs) give
    exactly what `feed` gives for a read of the events each takes, and decline (None) every
    read holding anything else, wherever that is: the fast paths never change what a stream
    means. Nor do they take a read when bytes are held or its last event is not ended."""
    rng = random.Random(7)
    for _ in range(3000):
        events = [
            rng.choice(taken if rng.random() < 0.8 else left) for _ in range(rng.randint(1, 5))
        ]
        read = b"".join(events)
        split = getattr(sse.SSEDecoder(), fast)(read)
        if all(e in taken for e in events):
            assert split == as_feed(sse.SSEDecoder().feed(read)), read
        else:
            assert split is None, read
    if fast == "feed_named":  # a read of one event is its bytes as read, not a copy
        assert sse.SSEDecoder().feed_named(taken[0]) == [(b'{"delta":"x"}', TEXT_DELTA, taken[0])]
        assert sse.SSEDecoder().feed_named(taken[0])[0][2] is taken[0]
        assert (
            sse.SSEDecoder().feed_named(taken[0] * 2, False)
            == [(b'{"delta":"x"}', TEXT_DELTA, None)] * 2
        )  # not asked for
    d = sse.SSEDecoder()
    assert d.feed(taken[0][:9]) == []
    assert getattr(d, fast)(taken[1]) is None  # held bytes come first
    for cut in (taken[0][:-1], taken[0][:-2]):
        assert getattr(sse.SSEDecoder(), fast)(taken[1] + cut) is None  # the last not ended
    faulted = sse.SSEDecoder(max_event_bytes=8)
    faulted.feed(b"data: more than eight bytes")
    assert faulted.fault is not None  # then every read is left to `feed`, which raises it
    assert getattr(faulted, fast)(taken[0]) is None and faulted.feed_one(_PLAIN[0]) is None
