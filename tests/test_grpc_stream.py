"""The gRPC front: a real grpc.aio client from the proto, through a real gateway, to the sim."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import grpc
import openai
import orjson
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests import procs
from tests.polling import until
from tokenpipe.front.grpc_gen import chat_pb2 as pb
from tokenpipe.front.grpc_gen import chat_pb2_grpc as pb_grpc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _grpc_gateway(sim: procs.Service, *extra: str) -> tuple[procs.Service, str]:
    """A gateway with a gRPC port in front of `sim`, and that port's target."""
    port = _free_port()
    # The later --grpc-port wins over procs.gateway's own "0" (off).
    gateway = procs.gateway("--grpc-port", str(port), "--upstream", sim.url + "/v1", *extra)
    return gateway, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def grpc_gateway(sim: procs.Service) -> Iterator[tuple[procs.Service, str]]:
    gateway, target = _grpc_gateway(sim)
    with gateway:
        yield gateway, target


def _request(rid: str, content: str, max_tokens: int = 10) -> pb.ClientMessage:
    return pb.ClientMessage(
        request=pb.ChatRequest(
            request_id=rid,
            model="sim-model",
            max_tokens=max_tokens,
            messages=[pb.Message(role="user", content=content)],
        )
    )


class Stream:
    """One ChatStream with a queue of client messages and per-request collected replies."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.outbox: asyncio.Queue[pb.ClientMessage | None] = asyncio.Queue()
        self.inbox: dict[str, list[pb.ServerMessage]] = {}
        self.changed = asyncio.Condition()

    async def _messages(self) -> AsyncIterator[pb.ClientMessage]:
        while (msg := await self.outbox.get()) is not None:
            yield msg

    async def __aenter__(self) -> Stream:
        self.call = pb_grpc.ChatStub(self.channel).ChatStream(self._messages())
        self.reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        async for msg in self.call:
            async with self.changed:
                self.inbox.setdefault(msg.request_id, []).append(msg)
                self.changed.notify_all()

    async def wait(self, pred: Any, timeout: float = 20) -> None:
        async with asyncio.timeout(timeout), self.changed:
            await self.changed.wait_for(pred)

    def text(self, rid: str) -> str:
        return "".join(m.delta.content for m in self.inbox.get(rid, ()) if m.HasField("delta"))

    def tokens(self, rid: str) -> int:
        return sum(m.delta.tokens for m in self.inbox.get(rid, ()) if m.HasField("delta"))

    def kinds(self, rid: str) -> list[str]:
        return [m.WhichOneof("kind") or "" for m in self.inbox.get(rid, ())]

    def finished(self, rid: str) -> bool:
        return any(k in ("done", "error") for k in self.kinds(rid))

    async def __aexit__(self, *exc: object) -> None:
        await self.outbox.put(None)
        try:
            async with asyncio.timeout(20):
                await self.reader
        finally:
            await self.channel.close()


def _direct_text(sim: procs.Service, content: str, max_tokens: int) -> str:
    c = openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(
        model="sim-model", max_tokens=max_tokens, messages=[{"role": "user", "content": content}]
    )
    return r.choices[0].message.content or ""


async def test_grpc_chat_streams_text_usage_and_done(sim: procs.Service, grpc_gateway: Any) -> None:
    _, target = grpc_gateway
    async with Stream(target) as s:
        await s.outbox.put(_request("a", "tell me about rivers", 12))
        await s.wait(lambda: s.finished("a"))
    assert s.text("a") == _direct_text(sim, "tell me about rivers", 12)
    assert s.tokens("a") == 12
    kinds = s.kinds("a")
    assert kinds[-2:] == ["usage", "done"]
    usage = s.inbox["a"][-2].usage
    assert usage.completion_tokens == 12 and usage.prompt_tokens > 0
    assert s.inbox["a"][-1].done.finish_reason == "length"


async def test_zero_credit_pauses_one_request_and_not_its_neighbour(grpc_gateway: Any) -> None:
    _, target = grpc_gateway
    async with Stream(target) as s:
        # Flow control before the request applies from the start: a pauses at once.
        await s.outbox.put(pb.ClientMessage(flow=pb.FlowControl(request_id="a", credit_tokens=0)))
        await s.outbox.put(_request("a", "[[sim itl_ms=1]] paused one", 40))
        await s.outbox.put(_request("b", "[[sim itl_ms=1]] free one", 40))
        await s.wait(lambda: s.finished("b"))
        assert s.tokens("b") == 40 and s.kinds("b")[-1] == "done"
        assert s.tokens("a") == 0 and not s.finished("a")  # b finished while a got nothing
        # Credit is additive and exact: 5 tokens, then a pause again.
        await s.outbox.put(pb.ClientMessage(flow=pb.FlowControl(request_id="a", credit_tokens=5)))
        await s.wait(lambda: s.tokens("a") >= 5)
        await s.outbox.put(_request("c", "[[sim itl_ms=1]] probe", 3))  # a round trip later ...
        await s.wait(lambda: s.finished("c"))
        assert s.tokens("a") == 5  # ... a still holds at its grant
        await s.outbox.put(pb.ClientMessage(flow=pb.FlowControl(request_id="a", credit_tokens=100)))
        await s.wait(lambda: s.finished("a"))
    assert s.tokens("a") == 40 and s.kinds("a")[-1] == "done"


async def test_cancel_stops_the_request_and_its_upstream_call(
    sim: procs.Service, grpc_gateway: Any
) -> None:
    _, target = grpc_gateway
    cancelled_before = await _sim_cancelled(sim)
    async with Stream(target) as s:
        await s.outbox.put(_request("slow", "[[sim itl_ms=50]] cancel me", 1000))
        await s.wait(lambda: s.tokens("slow") >= 2)
        await s.outbox.put(pb.ClientMessage(cancel=pb.Cancel(request_id="slow")))
        await s.outbox.put(_request("after", "[[sim itl_ms=1]] next", 3))
        await s.wait(lambda: s.finished("after"))
    assert not s.finished("slow") and s.tokens("slow") < 1000
    # The upstream call was closed: poll the sim's counter (bounded wait, not a sleep).
    deadline = asyncio.get_running_loop().time() + 5
    while await _sim_cancelled(sim) == cancelled_before:
        assert asyncio.get_running_loop().time() < deadline, "the sim never saw the cancel"
        await asyncio.sleep(0.01)


async def _sim_cancelled(sim: procs.Service) -> int:
    async with aiohttp.ClientSession() as http, http.get(sim.url + "/sim/stats?last=0") as r:
        return int((await r.json())["outcomes"].get("cancelled", 0))


async def test_upstream_errors_arrive_as_error_messages(grpc_gateway: Any) -> None:
    _, target = grpc_gateway
    async with Stream(target) as s:
        await s.outbox.put(_request("e", "[[sim fault=status:503]]"))
        await s.outbox.put(
            pb.ClientMessage(
                request=pb.ChatRequest(
                    request_id="m",
                    model="no-such-model",
                    messages=[pb.Message(role="user", content="x")],
                )
            )
        )
        await s.outbox.put(_request("r", "[[sim fault=reset:3]]", 20))
        await s.wait(lambda: all(s.finished(r) for r in "emr"))
    assert s.inbox["e"][-1].error.status == 503
    assert s.inbox["m"][-1].error.status == 404
    assert s.tokens("r") == 3 and s.inbox["r"][-1].error.status == 502
    assert "3 content deltas" in s.inbox["r"][-1].error.message


async def test_a_request_id_past_its_bound_is_refused_and_the_stream_goes_on(
    grpc_gateway: Any,
) -> None:
    """Up to 256 open requests are kept by their id: a 4 MB id each held 1 GB a stream."""
    _, target = grpc_gateway
    long_id = "i" * 5000
    async with Stream(target) as s:
        await s.outbox.put(_request(long_id, "hi"))
        await s.outbox.put(pb.ClientMessage(flow=pb.FlowControl(request_id=long_id + "f")))
        await s.outbox.put(_request("ok", "hi"))
        await s.wait(lambda: s.finished("ok") and len(s.inbox.get("i" * 256, ())) == 2)
    errors = [m.error for m in s.inbox["i" * 256]]
    assert all(e.status == 400 and "request_id is longer" in e.message for e in errors)
    assert s.kinds("ok")[-1] == "done"


async def test_server_reflection_lists_the_chat_service(grpc_gateway: Any) -> None:
    _, target = grpc_gateway
    async with grpc.aio.insecure_channel(target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)

        async def one() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for resp in stub.ServerReflectionInfo(one()):
            names = [s.name for s in resp.list_services_response.service]
            break
    assert "tokenpipe.v1.Chat" in names


async def test_log_lines_of_a_grpc_request_carry_its_upstream_request_id(
    sim: procs.Service,
) -> None:
    gateway, target = _grpc_gateway(sim, "--log-format", "json")
    with gateway as g:
        async with Stream(target) as s:
            # A 429 makes the limiter log that it pauses the upstream, inside the request.
            await s.outbox.put(_request("limited", "[[sim fault=status:429]]"))
            await s.wait(lambda: s.finished("limited"))

            # The gateway writes its log lines from a thread of their own: the line may come
            # after the answer (waited for, bounded).
            async def paused_lines() -> list[dict[str, Any]]:
                lines = g.output().splitlines()
                records = [orjson.loads(line) for line in lines if line.startswith("{")]
                return [r for r in records if "answered 429" in r["message"]]

            paused = await until(paused_lines, 10, "the limiter's log line of the 429")
    async with (
        aiohttp.ClientSession() as http,
        http.get(sim.url + "/sim/stats?last=1000") as r,
    ):
        limited = {x["id"] for x in (await r.json())["records"] if x["status"] == 429}
    assert all(rec.get("request_id") in limited for rec in paused), (paused, limited)


async def test_workers_share_the_grpc_port(sim: procs.Service) -> None:
    """`serve --workers 2`: both processes serve the gRPC port (SO_REUSEPORT, grpc's default),
    and requests on separate connections, which the kernel spreads over them, all complete."""
    gateway, target = _grpc_gateway(sim, "--workers", "2")
    with gateway:
        for i in range(6):  # a new channel (connection) each time
            async with grpc.aio.insecure_channel(target) as ch:
                await asyncio.wait_for(ch.channel_ready(), 20)
                call = pb_grpc.ChatStub(ch).ChatStream(iter([_request(f"w{i}", "hi", 5)]))
                kinds = [msg.WhichOneof("kind") async for msg in call]
            assert kinds[-1] == "done", kinds
        async with asyncio.timeout(20):  # both workers bound it (the second may start later)
            while gateway.output().count("gRPC listening on") < 2:
                await asyncio.sleep(0.05)
