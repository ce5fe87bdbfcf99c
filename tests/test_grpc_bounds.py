"""Bounds on what one gRPC client holds in the gateway: flow state for ids with no running
request (MAX_PENDING_FLOWS a stream, least recently touched dropped) and streams on one
connection (MAX_CONCURRENT_STREAMS, the excess queued by the client). A real gateway and sim on
loopback, a real grpc.aio client; the flow bound's bookkeeping is also checked in-process."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from tests import procs
from tests.test_grpc_stream import Stream, _grpc_gateway, _request
from tokenpipe.front import grpc as front
from tokenpipe.front.grpc_gen import chat_pb2 as pb
from tokenpipe.front.grpc_gen import chat_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def grpc_gateway(sim: procs.Service) -> Iterator[tuple[procs.Service, str]]:
    gateway, target = _grpc_gateway(sim)
    with gateway:
        yield gateway, target


def _flow(rid: str, credit: int = 1) -> pb.ClientMessage:
    return pb.ClientMessage(flow=pb.FlowControl(request_id=rid, credit_tokens=credit))


async def test_flow_controls_for_ids_never_started_refuse_nothing(grpc_gateway: Any) -> None:
    """1,000 FlowControls for ids that never start: no reply to any (the state of all but the
    last MAX_PENDING_FLOWS is dropped), and a request after them is served. Before, each id
    held ~1.2 KiB until the stream ended, and past 256 of them every message was a 429."""
    _, target = grpc_gateway
    async with Stream(target) as s:
        for i in range(1000):
            await s.outbox.put(_flow(f"never-{i}-".ljust(256, "x")))
        await s.outbox.put(_request("r", "after the flood", 5))
        await s.wait(lambda: s.finished("r"))  # messages are read in order: all flows were seen
    assert s.kinds("r")[-1] == "done" and s.tokens("r") == 5
    assert set(s.inbox) == {"r"}, {k: s.kinds(k) for k in s.inbox}


async def test_a_grant_after_its_request_ended_holds_no_slot(grpc_gateway: Any) -> None:
    """A client in credit mode grants as it reads, so a grant often arrives after its request's
    Done. 300 such late grants on one stream: every request is still served. Before, each kept
    a slot until the stream ended and the 257th on was refused with 429."""
    _, target = grpc_gateway
    async with Stream(target) as s:
        for batch in range(3):
            rids = [f"b{batch}-{i}" for i in range(100)]
            for rid in rids:
                await s.outbox.put(_request(rid, "short", 1))
            await s.wait(lambda rids=rids: all(s.finished(r) for r in rids))
            for rid in rids:
                await s.outbox.put(_flow(rid, 10))
        await s.outbox.put(_request("last", "after the late grants", 3))
        await s.wait(lambda: s.finished("last"))
    not_done = {k: s.kinds(k)[-1] for k in s.inbox if s.kinds(k)[-1] != "done"}
    assert not not_done, not_done
    assert len(s.inbox) == 301


async def test_a_flow_control_ahead_applies_within_its_bound_and_is_dropped_past_it(
    grpc_gateway: Any,
) -> None:
    """A zero grant sent ahead pauses its request from the start while fewer than
    MAX_PENDING_FLOWS other ids were touched since; past that it was dropped and the request
    runs without a grant (before, it was kept whatever came after it)."""
    _, target = grpc_gateway
    n = front.MAX_PENDING_FLOWS
    async with Stream(target) as s:
        await s.outbox.put(_flow("kept", 0))
        for i in range(n - 1):
            await s.outbox.put(_flow(f"other-{i}"))
        await s.outbox.put(_request("kept", "[[sim itl_ms=1]] paused", 20))
        await s.outbox.put(_request("probe", "[[sim itl_ms=1]] free", 20))
        await s.wait(lambda: s.finished("probe"))
        assert s.tokens("kept") == 0 and not s.finished("kept")  # probe finished, kept paused
        await s.outbox.put(_flow("kept", 100))
        await s.wait(lambda: s.finished("kept"))
        assert s.kinds("kept")[-1] == "done" and s.tokens("kept") == 20

        await s.outbox.put(_flow("dropped", 0))
        for i in range(n):
            await s.outbox.put(_flow(f"more-{i}"))
        await s.outbox.put(_request("dropped", "[[sim itl_ms=1]] not paused", 20))
        await s.wait(lambda: s.finished("dropped"))
    assert s.kinds("dropped")[-1] == "done" and s.tokens("dropped") == 20


class _Context:
    """What _Session needs of a grpc ServicerContext when only FlowControl and Cancel arrive."""

    def __init__(self) -> None:
        self.written: list[pb.ServerMessage] = []

    async def write(self, message: pb.ServerMessage) -> None:
        self.written.append(message)


async def _messages(*msgs: pb.ClientMessage) -> AsyncIterator[pb.ClientMessage]:
    for m in msgs:
        yield m


async def test_pending_flow_state_is_bounded_least_recently_touched_dropped() -> None:
    n = front.MAX_PENDING_FLOWS
    session = front._Session(gateway=None, context=_Context(), key="")  # type: ignore[arg-type]
    flows = [_flow("first", 0)] + [_flow(f"id-{i}") for i in range(2 * n)]
    flows.insert(len(flows) - (n - 1), _flow("first", 5))  # touched again, n - 1 ids before the end
    await session.run(_messages(*flows))
    kept = list(session.pending)
    assert len(kept) == n and "id-0" not in kept
    assert kept[0] == "first" and kept[-1] == f"id-{2 * n - 1}"
    assert session.pending["first"].credit == 5
    # A Cancel takes back a FlowControl sent ahead.
    await session.run(_messages(pb.ClientMessage(cancel=pb.Cancel(request_id="first"))))
    assert "first" not in session.pending and len(session.pending) == n - 1
    assert not session.requests and not session.context.written


_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def _server_settings(target: str) -> dict[int, int]:
    """The HTTP/2 SETTINGS the gateway's gRPC port sends a new connection."""
    host, port = target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        buf = b""
        while True:
            while len(buf) < 9 or len(buf) < 9 + int.from_bytes(buf[:3], "big"):
                chunk = sock.recv(65536)
                assert chunk, "the server closed before its SETTINGS"
                buf += chunk
            length, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
            payload, buf = buf[9 : 9 + length], buf[9 + length :]
            if kind == 0x4 and not flags & 0x1:  # SETTINGS, not an ACK
                return dict(struct.iter_unpack(">HI", payload))


async def test_one_connection_holds_at_most_max_concurrent_streams(grpc_gateway: Any) -> None:
    """The bound is advertised (SETTINGS_MAX_CONCURRENT_STREAMS); with that many calls open on
    one channel the next one waits (a call on another connection is served meanwhile) and runs
    once one of them ends."""
    _, target = grpc_gateway
    n = front.MAX_CONCURRENT_STREAMS
    assert (await asyncio.to_thread(_server_settings, target)).get(0x3) == n
    # A channel of its own: grpc shares one connection among a process's channels to a target.
    async with grpc.aio.insecure_channel(target, options=_OWN_CONNECTION) as channel:
        stub = pb_grpc.ChatStub(channel)
        outboxes: list[asyncio.Queue[pb.ClientMessage | None]] = []
        replies: list[list[pb.ServerMessage]] = []
        readers: list[asyncio.Task[None]] = []
        arrived = asyncio.Condition()

        async def open_call() -> int:
            outbox: asyncio.Queue[pb.ClientMessage | None] = asyncio.Queue()
            got: list[pb.ServerMessage] = []
            call = stub.ChatStream(_from(outbox))

            async def read() -> None:
                async for msg in call:
                    async with arrived:
                        got.append(msg)
                        arrived.notify_all()

            outboxes.append(outbox)
            replies.append(got)
            readers.append(asyncio.create_task(read()))
            return len(outboxes) - 1

        async def done(i: int) -> None:
            async with asyncio.timeout(20), arrived:
                await arrived.wait_for(lambda: any(m.HasField("done") for m in replies[i]))

        try:
            for i in range(n):  # n calls, each served once and kept open
                await outboxes[await open_call()].put(_request(f"open-{i}", "hi", 1))
            await asyncio.gather(*(done(i) for i in range(n)))
            extra = await open_call()
            await outboxes[extra].put(_request("extra", "hi", 1))
            async with grpc.aio.insecure_channel(target, options=_OWN_CONNECTION) as other:
                call = pb_grpc.ChatStub(other).ChatStream(iter([_request("other", "hi", 5)]))
                kinds = [msg.WhichOneof("kind") async for msg in call]
            assert kinds[-1] == "done", kinds  # another connection is served meanwhile
            assert not replies[extra]  # still queued behind the n open calls
            await outboxes[0].put(None)  # one call ends: the queued one runs
            await done(extra)
        finally:
            for outbox in outboxes:
                await outbox.put(None)
            async with asyncio.timeout(20):
                await asyncio.gather(*readers)


async def _from(
    outbox: asyncio.Queue[pb.ClientMessage | None],
) -> AsyncIterator[pb.ClientMessage]:
    while (msg := await outbox.get()) is not None:
        yield msg


async def test_a_request_past_the_messages_bound_is_refused_and_the_next_served(
    grpc_gateway: Any,
) -> None:
    """A ChatRequest of more than MAX_MESSAGES messages is an Error 400 naming the bound,
    found before a dict is made of each (2 M empty messages fit in 4 MiB: 0.8 s of the event
    loop, before); the stream goes on."""
    _, target = grpc_gateway
    many = _request("many", "hi", 5)
    many.request.messages.extend([pb.Message(role="user")] * front.schema.MAX_MESSAGES)
    async with Stream(target) as s:
        await s.outbox.put(many)
        await s.outbox.put(_request("after", "hi", 5))
        await s.wait(lambda: s.finished("many") and s.finished("after"))
    refused = s.inbox["many"][-1]
    assert refused.WhichOneof("kind") == "error" and refused.error.status == 400
    assert "length <= 10000" in refused.error.message
    assert s.kinds("after")[-1] == "done"
