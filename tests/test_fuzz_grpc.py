"""Hostile input on the gRPC front: malformed protobuf, oversized messages, a stream that never
ends, hypothesis-made requests. Each call ends with a status (no hang), the process survives,
its memory stays bounded and a well-behaved client on the same gateway is served throughout.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import procs
from tokenpipe.front.grpc_gen import chat_pb2 as pb
from tokenpipe.front.grpc_gen import chat_pb2_grpc as pb_grpc

METHOD = "/tokenpipe.v1.Chat/ChatStream"
MAX_BODY = 65536  # server.max_body_bytes: also the gRPC message limit (bytes)
#: Every call must end within this (seconds); longer counts as a hang.
ENDS_WITHIN = 15.0
RSS_GROWTH_BOUND = 64 * 1024 * 1024  # bytes
COUNTS_FILE = Path(".cache/fuzz-counts-grpc.json")
COUNTS: dict[str, int] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def grpc_target(
    sim: procs.Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[procs.Service, str]]:
    port = _free_port()
    cfg = tmp_path_factory.mktemp("grpcfuzz") / "gw.yaml"
    cfg.write_text(
        f"server:\n  max_body_bytes: {MAX_BODY}\n  grpc_port: {port}\n"
        f"upstreams:\n  - name: sim\n    url: {sim.url}/v1\n"
    )
    with procs.Service("serve", "--port", "0", "--config", str(cfg), name="gateway") as g:
        g.rss_start = psutil.Process(g.pid).memory_info().rss  # type: ignore[attr-defined]
        yield g, f"127.0.0.1:{port}"
    COUNTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    COUNTS_FILE.write_text(json.dumps(COUNTS, indent=1, sort_keys=True))


def _count(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


def _raw_call(target: str, frames: list[bytes]) -> tuple[grpc.StatusCode, list[bytes]]:
    """Sends `frames` as raw message bytes (no protobuf encoding on our side)."""
    with grpc.insecure_channel(
        target, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)]
    ) as ch:
        call = ch.stream_stream(METHOD, request_serializer=None, response_deserializer=None)
        replies: list[bytes] = []
        try:
            for reply in call(iter(frames), timeout=ENDS_WITHIN):
                replies.append(reply)
        except grpc.RpcError as e:
            code = e.code()
            assert code != grpc.StatusCode.DEADLINE_EXCEEDED, "the call hung"
            return code, replies
        return grpc.StatusCode.OK, replies


def _valid(rid: str = "ok", max_tokens: int = 3) -> bytes:
    return pb.ClientMessage(
        request=pb.ChatRequest(
            request_id=rid,
            model="sim-model",
            max_tokens=max_tokens,
            messages=[pb.Message(role="user", content="hi")],
        )
    ).SerializeToString()


def _well_behaved_client_is_served(target: str) -> None:
    code, replies = _raw_call(target, [_valid()])
    assert code == grpc.StatusCode.OK
    kinds = [pb.ServerMessage.FromString(r).WhichOneof("kind") for r in replies]
    assert kinds[-1] == "done", [pb.ServerMessage.FromString(r) for r in replies]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(frame=st.binary(max_size=256))
def test_malformed_protobuf_ends_the_call_with_a_status(
    grpc_target: tuple[procs.Service, str], frame: bytes
) -> None:
    _count("hypothesis malformed protobuf frames")
    code, _ = _raw_call(grpc_target[1], [frame])
    # Bytes that happen to decode are a (possibly empty) valid message: OK. Bytes that do not
    # are the client's mistake: INVALID_ARGUMENT (grpc's own default would be UNKNOWN with a
    # traceback in the log).
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), code


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    rid=st.text(max_size=300),
    model=st.text(max_size=40),
    role=st.text(max_size=12),
    content=st.text(max_size=200),
    max_tokens=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    temperature=st.floats(allow_nan=True, allow_infinity=True, width=32),
)
def test_any_field_values_get_done_or_an_error_message(
    grpc_target: tuple[procs.Service, str],
    rid: str,
    model: str,
    role: str,
    content: str,
    max_tokens: int,
    temperature: float,
) -> None:
    _count("hypothesis ChatRequest field values")
    msg = pb.ClientMessage(
        request=pb.ChatRequest(
            request_id=rid,
            model=model,
            max_tokens=max_tokens,
            temperature=temperature,
            messages=[pb.Message(role=role, content=content)],
        )
    )
    code, replies = _raw_call(grpc_target[1], [msg.SerializeToString()])
    assert code == grpc.StatusCode.OK, code
    kinds = [pb.ServerMessage.FromString(r).WhichOneof("kind") for r in replies]
    assert kinds and kinds[-1] in ("done", "error"), kinds
    for r in replies:
        m = pb.ServerMessage.FromString(r)
        if m.HasField("error"):
            assert m.error.status < 500 or m.error.status in (502, 504), m.error


def test_oversized_message_is_refused_and_others_are_served(
    grpc_target: tuple[procs.Service, str],
) -> None:
    _count("oversized message")
    huge = pb.ClientMessage(
        request=pb.ChatRequest(
            request_id="big",
            model="sim-model",
            messages=[pb.Message(role="user", content="x" * (MAX_BODY * 4))],
        )
    ).SerializeToString()
    code, _ = _raw_call(grpc_target[1], [huge])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    _well_behaved_client_is_served(grpc_target[1])


async def test_never_ending_stream_is_bounded_and_others_are_served(
    grpc_target: tuple[procs.Service, str],
) -> None:
    """A client that sends FlowControls forever, each naming a new request that never comes:
    the gateway keeps flow state for at most MAX_PENDING_FLOWS of them (the least recently
    touched dropped, nothing refused), a request the client sends every 1,000 messages is
    served, its memory stays put, and a neighbour is served meanwhile."""
    g, target = grpc_target
    _count("never-ending stream")
    sent = 0
    stop = asyncio.Event()

    async def forever() -> AsyncIterator[pb.ClientMessage]:
        nonlocal sent
        while not stop.is_set():
            sent += 1
            yield pb.ClientMessage(
                flow=pb.FlowControl(request_id=f"r{sent}-" + "x" * 200, credit_tokens=1)
            )
            if sent % 100 == 0:
                await asyncio.sleep(0)  # let the channel flush; not synchronisation
            if sent % 1000 == 0:
                yield pb.ClientMessage.FromString(_valid(f"probe-{sent}", max_tokens=1))

    replies: list[pb.ServerMessage] = []
    async with grpc.aio.insecure_channel(target) as ch:
        call = pb_grpc.ChatStub(ch).ChatStream(forever())
        probes = 0
        async with asyncio.timeout(60):
            async for msg in call:
                replies.append(msg)
                # Messages are read in order: a probe's Done means the 1,000 before it were read.
                if msg.HasField("done"):
                    probes += 1
                    if probes >= 6:
                        break
        await asyncio.to_thread(_well_behaved_client_is_served, target)
        stop.set()
        call.cancel()
    assert sent >= 6000
    refused = [m for m in replies if not m.request_id.startswith("probe-")]
    assert not refused, refused[:3]
    COUNTS["never-ending stream: messages sent"] = sent
    rss = psutil.Process(g.pid).memory_info().rss
    assert rss - g.rss_start < RSS_GROWTH_BOUND, (rss, g.rss_start)
    await asyncio.to_thread(_well_behaved_client_is_served, target)
    COUNTS["total"] = sum(
        v for k, v in COUNTS.items() if not k.startswith(("total", "never-ending stream:"))
    )
