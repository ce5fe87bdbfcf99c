"""The relay's per-event logic on its own: parsing (fast and general paths agree), merging,
and who writes (the reader only when nothing is queued)."""

from __future__ import annotations

import asyncio
import random
import time

import orjson
import pytest

from tokenpipe import sse
from tokenpipe.dialects import CHAT, Piece
from tokenpipe.errors import GatewayError
from tokenpipe.relay.buffer import Accumulator
from tokenpipe.relay.events import EventParser
from tokenpipe.relay.stream import relay_stream
from tokenpipe.relay.tally import StreamTally


def _chunk(delta: dict | None = None, finish: str | None = None, **extra: object) -> bytes:
    choice: dict = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    obj = {"id": "c1", "object": "chat.completion.chunk", "choices": [choice], **extra}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


STREAM = [
    _chunk({"role": "assistant", "content": ""}, usage=None),
    *(_chunk({"content": f" w{i}"}, usage=None) for i in range(20)),
    _chunk({}, "stop", usage=None),
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":20}}\n\n',
    sse.DONE_EVENT,
]


def _parse(reads: list[bytes], strip: bool) -> tuple[list[Piece], StreamTally]:
    tally = StreamTally("u", "m", time.perf_counter())
    parser = EventParser(tally, strip, CHAT)
    pieces: list[Piece] = []
    for r in reads:
        pieces += parser.feed(r)
    return pieces, tally


def test_a_chat_upstreams_named_events_reach_the_client_as_data_events() -> None:
    """Chat's client reads `data:` events only (the SDK reads a named event as another kind
    of event): an upstream's `event:` lines are left out, whether it reads one at a time or
    all at once (the parser's fast path for named events)."""
    named = [b"event: message\n" + e for e in STREAM]
    for reads in (named, [b"".join(named)]):
        pieces, tally = _parse(reads, False)
        assert b"".join(p.event() for p in pieces) == b"".join(STREAM)
        assert tally.usage == {"prompt_tokens": 3, "completion_tokens": 20} and tally.done


def _queued(pieces: list[Piece]) -> Accumulator:
    """An accumulator holding these pieces, as a reader behind its client leaves them."""
    acc = Accumulator()
    for p in pieces:
        acc.put(p)
    return acc


@pytest.mark.parametrize("strip", [True, False])
def test_any_split_of_the_reads_gives_the_same_events_text_and_usage(strip: bool) -> None:
    whole, tally = _parse(STREAM, strip)  # one event per read: the fast path
    body = b"".join(STREAM)
    rng = random.Random(5)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(body)), 12))
        reads = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        split, t2 = _parse(reads, strip)  # the general path
        assert [p.event() for p in split] == [p.event() for p in whole]
        assert [p.count for p in split] == [p.count for p in whole]
        assert t2.usage == tally.usage == {"prompt_tokens": 3, "completion_tokens": 20}
        assert t2.done and t2.finished
    text = "".join(p.text for p in whole)
    assert text == "".join(f" w{i}" for i in range(20))
    if strip:  # what the gateway asked for on the client's behalf is gone again
        assert all(b"usage" not in p.event() for p in whole)
        assert len(whole) == len(STREAM) - 1
    else:
        assert len(whole) == len(STREAM)


def test_shapes_the_typed_decode_refuses_are_judged_on_the_dict() -> None:
    two_choices = orjson.dumps(
        {"choices": [{"index": 0, "delta": {"content": "a"}}, {"index": 1, "delta": "odd"}]}
    )
    tool = _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]})
    error = b'data: {"error":{"message":"overloaded","type":"server_error"}}\n\n'
    pieces, tally = _parse([b"data: " + two_choices + b"\n\n", tool, error], True)
    assert [p.count for p in pieces] == [1, 1, 0]
    assert pieces[0].text == "a"
    assert pieces[2].error == {"message": "overloaded", "type": "server_error"}
    assert tally.finished


@pytest.mark.parametrize("bad", [b"data: {not json\n\n", b"data: [1,2]\n\n"])
def test_broken_events_are_protocol_errors(bad: bytes) -> None:
    good = _chunk({"content": "x"})
    tally = StreamTally("u", "m", time.perf_counter())
    parser = EventParser(tally, False, CHAT)
    # The good event before the bad one in the same read is kept; the one after it is not.
    pieces = parser.feed(good + bad + good)
    assert [p.text for p in pieces] == ["x"]
    with pytest.raises(sse.SSEProtocolError):
        parser.at_end()
    with pytest.raises(sse.SSEProtocolError):
        parser.feed(good)  # nothing after the fault is parsed


def test_crlf_split_between_cr_and_lf_inside_a_multi_line_event() -> None:
    body = b'data: {"choices":[{"index":0,\r\ndata: "delta":{"content":"x"}}]}\r\n\r\n'
    cut = body.index(b"\r\n") + 1
    pieces, _ = _parse([body[:cut], body[cut:]], False)
    assert [p.text for p in pieces] == ["x"]


def test_nothing_after_done_is_passed_on() -> None:
    pieces, tally = _parse([sse.DONE_EVENT + _chunk({"content": "late"}) + sse.DONE_EVENT], False)
    assert [p.event() for p in pieces] == [sse.DONE_EVENT] and tally.done


def test_crlf_and_comment_events_pass() -> None:
    pieces, _ = _parse(
        [b": ping\r\n\r\n" + _chunk({"content": "x"}).replace(b"\n", b"\r\n")], False
    )
    assert pieces[0].event() == b": ping\n\n" and pieces[1].text == "x"


def test_queued_content_merges_into_one_event_with_the_same_text() -> None:
    pieces, _ = _parse(STREAM, True)
    out, tokens = _queued(pieces).take(1 << 30)
    assert tokens == 20
    # role chunk, one merged content event, finish, [DONE]
    assert len(out) == 4 and out[1].count == 20
    merged = orjson.loads(out[1].event()[6:-2])
    assert merged["choices"][0]["delta"] == {"content": "".join(f" w{i}" for i in range(20))}
    # Split by a credit of 5: the first 5 deltas, then the rest, nothing lost.
    again, _ = _parse(STREAM, True)
    acc = _queued(again[1:21])
    head, n = acc.take(5)
    rest, m = acc.take(1 << 30)
    assert (n, m) == (5, 15)
    assert "".join(p.text for p in head + rest) == "".join(f" w{i}" for i in range(20))


async def test_the_reader_writes_itself_only_when_nothing_is_queued() -> None:
    written: list[bytes] = []

    def write_now(pieces: list[Piece]) -> None:
        written.extend(p.event() for p in pieces)

    acc = Accumulator(None, write_now, lambda: True)
    pieces, _ = _parse(STREAM[:4], False)
    waiter = asyncio.create_task(acc.wait_data())
    await asyncio.sleep(0)  # the writer parks: idle, nothing pending
    assert acc.idle
    assert not acc.deliver([pieces[0]])
    assert written == [pieces[0].event()] and not acc.pending  # written by the reader
    acc.put(pieces[1])  # queued (e.g. a hedge's first events): the writer is woken ...
    acc.deliver([pieces[2]])  # ... but has not run yet: this must queue behind it
    assert written == [pieces[0].event()]
    assert [p.count for p in acc.pending] == [2]  # merged behind the queued one, in order
    await waiter


async def test_a_client_that_went_away_fails_the_direct_write_and_the_writer_reraises() -> None:
    def write_now(pieces: list[Piece]) -> None:
        raise ConnectionResetError("gone")

    acc = Accumulator(None, write_now, lambda: True)
    pieces, _ = _parse(STREAM[:2], False)
    waiter = asyncio.create_task(acc.wait_data())
    await asyncio.sleep(0)
    with pytest.raises(ConnectionResetError):
        acc.deliver([pieces[1]])
    assert isinstance(acc.write_error, ConnectionResetError)
    acc.close()
    await waiter


def test_a_delta_with_a_role_or_a_tool_call_is_never_merged_into() -> None:
    reads = [
        _chunk({"role": "assistant", "content": "Hi"}),
        _chunk({"content": " there"}),
        _chunk({"content": "!", "tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
        _chunk({"content": " more"}),
        _chunk({"content": " text"}),
    ]
    pieces, _ = _parse(reads, False)
    out, tokens = _queued(pieces).take(1 << 30)
    assert tokens == 5
    assert [p.count for p in out] == [1, 1, 1, 2]  # only the last two plain deltas joined
    assert out[0].event() == reads[0] and out[2].event() == reads[2]  # passed as sent
    assert orjson.loads(out[3].event()[6:-2])["choices"][0]["delta"] == {"content": " more text"}


async def test_a_client_that_keeps_up_is_written_by_the_reader_in_the_callers_task() -> None:
    pieces, _ = _parse(STREAM, False)
    written: list[bytes] = []
    tasks_seen: list[int] = []
    me = asyncio.current_task()

    def write_now(ps: list[Piece]) -> None:
        assert asyncio.current_task() is me  # the reader runs in the caller's task
        written.extend(p.event() for p in ps)

    async def emit(ps: list[Piece]) -> None:
        raise AssertionError("no writer task for a client that keeps up")

    async def read(acc: Accumulator) -> None:
        assert acc.task is me  # the reader's timers are given it (router/race, router/stream)
        for p in pieces:
            acc.deliver([p])
            tasks_seen.append(len(asyncio.all_tasks()))
            await asyncio.sleep(0)

    before = len(asyncio.all_tasks())
    assert await relay_stream(read, emit, write_now=write_now, ready=lambda: True) is None
    assert written == [p.event() for p in pieces]
    assert set(tasks_seen) == {before}  # no task was started for the stream


async def test_what_queues_is_sent_by_a_writer_task_in_order_and_the_error_returned() -> None:
    pieces, _ = _parse(STREAM, False)
    sent: list[Piece] = []
    client_ready = True
    broke = GatewayError(502, "cut", code="upstream_stream_truncated")

    def write_now(ps: list[Piece]) -> None:
        sent.extend(ps)

    async def emit(ps: list[Piece]) -> None:
        assert asyncio.current_task() is not me
        sent.extend(ps)

    async def read(acc: Accumulator) -> GatewayError:
        nonlocal client_ready
        for i, p in enumerate(pieces[:10]):
            client_ready = i not in (3, 4, 5)  # the client falls behind for three pieces
            acc.deliver([p])
            await asyncio.sleep(0)
        return broke

    me = asyncio.current_task()
    error = await relay_stream(read, emit, write_now=write_now, ready=lambda: client_ready)
    assert error is broke
    assert "".join(p.text for p in sent) == "".join(p.text for p in pieces[:10])


async def test_a_failed_write_of_the_writer_task_stops_the_reader_and_is_raised() -> None:
    pieces, _ = _parse(STREAM, False)
    reading = asyncio.Event()
    reader_cancelled = False

    async def emit(ps: list[Piece]) -> None:
        await reading.wait()
        raise ConnectionResetError("the client went away")

    async def read(acc: Accumulator) -> None:
        nonlocal reader_cancelled
        acc.deliver([pieces[0]])  # no direct writes: it queues, the writer task starts
        reading.set()
        try:
            await asyncio.Event().wait()  # an upstream that sends nothing more
        except asyncio.CancelledError:
            reader_cancelled = True
            raise

    with pytest.raises(ConnectionResetError):
        await relay_stream(read, emit)
    assert reader_cancelled
    me = asyncio.current_task()
    assert me is not None and me.cancelling() == 0  # the writer's cancel does not linger
    await asyncio.sleep(0)  # (a pending cancel would be raised here)
