"""A finished request leaves nothing that only the cyclic garbage collector can free.

A reference cycle anywhere in a request's objects keeps all of them alive (its task, its
frames, its request and answer) until a young collection finds them: 31 objects a streamed
request did (an accumulator holding its writer's bound method, the writer holding the
accumulator and the task), and the gateway then spent ~16 us a request in the collector
(docs/performance.md). Here a real gateway, in this process so its garbage can be seen,
answers each API's requests, streamed and not, native and translated, and errors, on a
kept-alive connection and on a connection a request, streams its client leaves and streams
its upstream breaks; with gc.DEBUG_SAVEALL the collector keeps what it would have freed, and
nothing of a request may be among it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import socket
import types
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest

from tests import procs
from tokenpipe import gateway
from tokenpipe.config_file import upstream_from_url
from tokenpipe.front.app import Front
from tokenpipe.settings import ContextModel, ContextSettings, Settings


@pytest.fixture(scope="module")
def responses_sim() -> Iterator[procs.Service]:
    """A sim that answers at once (every API it serves natively, Responses too)."""
    with procs.sim("--ttft-ms", "0", "--itl-ms", "0", "--output-tokens", "4") as s:
        yield s


_CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
_MESSAGES = _CHAT  # the same body is a Messages request (max_tokens is required there)
_PROMPT = {"model": "sim-model", "prompt": "hi", "max_tokens": 4}
_INPUT = {"model": "sim-model", "input": "hi", "max_output_tokens": 16}
#: (path, body, status through an OpenAI upstream, through an Anthropic one) of each kind
#: of request: every API, streamed and whole, native and translated, and refusals. An
#: Anthropic upstream serves chat (translated) and Messages only: the model is not there for
#: the rest (404).
_REQUESTS: list[tuple[str, dict[str, Any], int, int]] = [
    ("/v1/chat/completions", {**_CHAT, "stream": True}, 200, 200),
    (
        "/v1/chat/completions",
        {**_CHAT, "stream": True, "stream_options": {"include_usage": True}},
        200,
        200,
    ),
    ("/v1/chat/completions", _CHAT, 200, 200),
    ("/v1/completions", {**_PROMPT, "stream": True}, 200, 404),
    ("/v1/completions", _PROMPT, 200, 404),
    ("/v1/messages", {**_MESSAGES, "stream": True}, 200, 200),
    ("/v1/messages", _MESSAGES, 200, 200),
    ("/v1/responses", {**_INPUT, "stream": True}, 200, 404),
    ("/v1/responses", _INPUT, 200, 404),
    ("/v1/embeddings", {"model": "sim-model", "input": "hi"}, 200, 404),
    ("/v1/chat/completions", {**_CHAT, "model": "no-such-model", "stream": True}, 404, 404),
    ("/v1/chat/completions", {"model": "sim-model"}, 400, 400),  # no messages
]


async def _answer_all(session: aiohttp.ClientSession, base: str, api: str) -> None:
    """Each request once, in order on one connection; the statuses are the table's."""
    statuses = []
    for path, body, *_ in _REQUESTS:
        async with session.post(base + path, json=body) as r:
            await r.read()
            statuses.append(r.status)
    await _settled(session, base)
    expected = [openai if api == "openai" else anthropic for *_, openai, anthropic in _REQUESTS]
    assert statuses == expected


@contextlib.asynccontextmanager
async def _serving(
    upstream: str, context: ContextSettings | None = None
) -> AsyncIterator[tuple[Front, str, aiohttp.ClientSession]]:
    """A gateway in this process in front of `upstream`, its base URL, and a client session
    with one connection: its requests are answered in order (see _settled)."""
    settings = Settings(upstreams=[upstream_from_url(upstream, 0)])
    if context is not None:
        settings.context = context
    settings.server.port = 0
    async with (
        gateway.running(settings) as (front, _, port),
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session,
    ):
        yield front, f"http://{settings.server.host}:{port}", session


async def _settled(session: aiohttp.ClientSession, base: str) -> None:
    """The connection answers one request at a time, in order: once this one is answered,
    every handler before it on `session`'s one connection has finished (its books too)."""
    async with session.get(base + "/healthz") as r:
        await r.read()


async def _garbage_of(run: Callable[[], Awaitable[object]]) -> list[str]:
    """Runs `run` with the collector keeping all it finds unreachable (DEBUG_SAVEALL): the
    gateway's part of it (`_requests_garbage`)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await run()
        return _requests_garbage()
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _requests_garbage() -> list[str]:
    """What the collector found unreachable (kept by DEBUG_SAVEALL) that is the gateway's: its
    objects, and tasks and coroutines running its code (the client's are aiohttp's)."""
    gc.collect()
    found = []
    for o in gc.garbage:
        if type(o).__module__.startswith("tokenpipe"):
            found.append(type(o).__qualname__)
        elif isinstance(o, asyncio.Task) and (name := _ours(o.get_coro())):
            found.append(f"Task {name}")
        elif name := _ours(o):
            found.append(f"coroutine {name}")
        elif isinstance(o, types.FrameType) and "/tokenpipe/" in o.f_code.co_filename:
            found.append(f"frame {o.f_code.co_qualname}")  # a traceback's
    return found


def _ours(o: object) -> str | None:
    """A coroutine running the gateway's code: its name."""
    if inspect.iscoroutine(o) and "/tokenpipe/" in o.cr_code.co_filename:
        return o.cr_code.co_qualname
    return None


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_no_request_leaves_cyclic_garbage(responses_sim: procs.Service, api: str) -> None:
    url = responses_sim.url + "/v1" if api == "openai" else f"anthropic+{responses_sim.url}/v1"
    async with _serving(url) as (_, base, session):
        await _answer_all(session, base, api)  # warm: caches, metric children, pools

        async def run() -> None:
            for _ in range(3):
                await _answer_all(session, base, api)
            # A connection a request: each closes once answered (the server closes it, and
            # forgets it before the client reads the end).
            async with aiohttp.ClientSession() as once:
                for _ in range(3):
                    body = {**_CHAT, "stream": True}
                    headers = {"Connection": "close"}
                    async with once.post(base + _REQUESTS[0][0], json=body, headers=headers) as r:
                        await r.read()
                        assert r.status == 200

        garbage = await _garbage_of(run)
    assert garbage == [], sorted(Counter(garbage).items())


async def test_a_stream_the_client_leaves_leaves_no_cyclic_garbage(
    responses_sim: procs.Service,
) -> None:
    """A client that stops reading and closes (a user's stop button) cuts the stream: its
    upstream connection is closed, not reused, and nothing of either waits for the
    collector."""
    slow = {
        **_CHAT,
        "stream": True,
        "messages": [{"role": "user", "content": "hi [[sim itl_ms=50 output_tokens=50]]"}],
    }
    async with _serving(responses_sim.url + "/v1") as (front, base, session):
        await _answer_all(session, base, "openai")  # warm

        async def run() -> None:
            for _ in range(3):
                # Left unread, the answer's connection is closed by aiohttp at the exit.
                async with (
                    aiohttp.ClientSession() as leaving,
                    leaving.post(base + _REQUESTS[0][0], json=slow) as r,
                ):
                    assert r.status == 200
                    assert await r.content.readany()  # the stream has begun
                    handlers = set(front.drain.tasks)
                assert handlers
                await asyncio.wait(handlers)
            # Once more round the loop for the cut upstream connection's close.
            await _answer_all(session, base, "openai")

        garbage = await _garbage_of(run)
    assert garbage == [], sorted(Counter(garbage).items())


async def _failing(
    upstream: str,
    body: dict[str, Any],
    times: int,
    headers: dict[str, str] | None = None,
    context: ContextSettings | None = None,
) -> list[str]:
    """`body` sent once (warm), then `times` more with the collector keeping all: each must
    fail (an error status, or a stream that ends with an error event). The garbage."""
    async with _serving(upstream, context) as (_, base, session):

        async def fail() -> None:
            async with session.post(base + _REQUESTS[0][0], json=body, headers=headers) as r:
                text = await r.text()
            assert r.status >= 500 or '"error"' in text, (r.status, text)

        async def run() -> None:
            for _ in range(times):
                await fail()
            await _settled(session, base)

        await fail()
        return await _garbage_of(run)


@pytest.mark.parametrize("fault", ["reset:0", "reset:2", "truncate:2", "garbage", "status:500"])
async def test_a_stream_that_fails_upstream_leaves_no_cyclic_garbage(
    responses_sim: procs.Service, fault: str
) -> None:
    """An upstream that breaks before the first token (retried), after some (the client gets
    an error event), with bytes that are not SSE, or with a 500: the error is stored where
    the stream's reader finds it, and its traceback holds the frames that hold that place.
    Dropped when the stream ends, the failed request is freed at once like any other."""
    content = f"hi [[sim fault={fault}]]"
    body = {**_CHAT, "stream": True, "messages": [{"role": "user", "content": content}]}
    garbage = await _failing(responses_sim.url + "/v1", body, 3)
    assert garbage == [], sorted(Counter(garbage).items())


async def test_requests_to_an_upstream_that_is_down_leave_no_cyclic_garbage() -> None:
    """Nothing listens at the upstream's port: connects fail, the circuit opens, and later
    requests wait for capacity until their deadline. Each failure is kept on its attempt
    and raised again by the route; neither may tie the request into a cycle."""
    with socket.socket() as s:  # a loopback port nothing listens on (free a moment ago)
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    deadline = {"x-tokenpipe-deadline-seconds": "0.3"}
    garbage = await _failing(down, {**_CHAT, "stream": True}, 6, deadline)
    assert garbage == [], sorted(Counter(garbage).items())


async def test_a_failed_summary_keeps_none_of_its_frames(responses_sim: procs.Service) -> None:
    """A summary call that fails (here: far past its max_tokens, as the sim's directive makes
    it) raised through the summary cache's shared future, which held the exception, whose
    traceback held the frames that held the future and the answer they read (up to 1 MiB,
    twice): a cycle a failure, left to the collector. With the collector off, none of the
    summary call's frames may outlive its request."""
    context = ContextSettings(
        summary_max_tokens=20,
        models=[ContextModel(name="sim-model", window=600, policy="summarize")],
    )
    history = []
    for t in range(40):
        words = " ".join(f"q{t}w{i}" for i in range(18))
        history.append({"role": "user", "content": f"[[sim output_tokens=400]] {words}"})
        history.append({"role": "assistant", "content": words})
    history.append({"role": "user", "content": "and the last question"})
    body = {**_CHAT, "messages": history}
    async with _serving(responses_sim.url + "/v1", context) as (_, base, session):
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                async with session.post(base + _REQUESTS[0][0], json=body) as r:
                    report = r.headers["x-tokenpipe-context"]
                    assert r.status == 200 and report.endswith("summary=failed"), report
            await _settled(session, base)
            frames = [
                o.f_code.co_qualname
                for o in gc.get_objects()
                if isinstance(o, types.FrameType) and "/tokenpipe/context/" in o.f_code.co_filename
            ]
        finally:
            gc.enable()
    assert frames == []
