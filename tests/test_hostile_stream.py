"""Hostile upstream bytes (issue 16, items 1, 7, 8), end to end on real sockets: the gateway as
a process in front of a scripted upstream (tests/hostile_upstream.py). Each test asserts the
exact event sequence the client gets: every good event up to the fault in order, then one
error event `upstream_protocol_error` and nothing after it (no content, no [DONE]); or the
whole stream with one [DONE]."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests import procs
from tests.hostile_upstream import (
    DONE,
    HostileUpstream,
    Reply,
    chat_chunk,
    http_chunk,
    json_reply,
    sse_reply,
    text_chunk,
)
from tests.sse_client import unchunk
from tokenpipe import sse

Chunk = Callable[..., bytes]
PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}
BAD = b"data: {not json}\n\n"
DEEP = b"data: " + b"[" * 1100 + b"]" * 1100 + b"\n\n"
UPGRADE = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
BAD_FRAMING = b"zz\r\nnot a chunk size\r\n"
#: A usage chunk whose counts are not counts (a string, a number past any window).
BAD_USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": "x", "completion_tokens": 1e30}}\n\n'


def _multiline_crlf(c: Chunk) -> list[bytes]:
    """One spec-valid event whose JSON spans two `data:` lines with CRLF line ends, split
    between the CR and the LF across two writes."""
    obj = c("crlf").removeprefix(b"data: ").removesuffix(b"\n\n")
    cut = obj.index(b'"choices"')
    event = b"data: " + obj[:cut] + b"\r\ndata: " + obj[cut:] + b"\r\n\r\n"
    split = event.index(b"\r\n") + 1
    return [event[:split], event[split:]]


def _script(kind: str, c: Chunk) -> Reply:
    """The upstream's answer for the scenario `kind`, in the shape `c` builds."""
    a, b = c("a"), c("b")
    stop = c("", "stop")
    scripts: dict[str, Reply] = {
        "good": sse_reply([a, b, stop + DONE]),
        "bad_one_write": sse_reply([a, b + BAD + c("c"), stop + DONE]),
        "bad_own_chunk": sse_reply([a, b, BAD, c("c"), stop + DONE]),
        "bad_unchunked": sse_reply([a, b + BAD + c("c"), stop + DONE], chunked=False),
        "comment_block": sse_reply([a, b": ping\n: data: [DONE]\n\n", b, stop + DONE]),
        "crlf_split": sse_reply([a, *_multiline_crlf(c), stop + DONE]),
        "inf_mid": sse_reply([a, b"data: 1e999\n\n", c("c"), DONE]),
        "inf_first": sse_reply([b"data: 1e999\n\n", a, DONE]),
        "deep_mid": sse_reply([a, DEEP, c("c"), DONE]),
        "deep_first": sse_reply([DEEP, a, DONE]),
        "framing_mid": Reply(sse_reply([]).head, [http_chunk(a), BAD_FRAMING]),
        "framing_first": Reply(sse_reply([]).head, [BAD_FRAMING]),
        "upgrade": Reply(UPGRADE, [b"\x81\x05hello"], hang=True),
        "after_done_one_write": sse_reply([a, stop + DONE + c("late") + DONE], hang=True),
        "after_done_writes": sse_reply([a, stop, DONE, c("late"), DONE], hang=True),
        "unary_not_json": json_reply(b"{not json"),
        "unary_not_object": json_reply(b"[1, 2, 3]"),
        "unary_deep": json_reply(b"[" * 1100 + b"]" * 1100),
        "usage_bad": sse_reply([a, stop, BAD_USAGE, DONE]),
    }
    return scripts[kind]


def _route(req: dict[str, Any]) -> Reply:
    """The scenario is named by the request's text; its shape by the API it came from."""
    if "messages" in req:
        return _script(req["messages"][0]["content"], chat_chunk)
    return _script(str(req.get("prompt")), text_chunk)


@pytest.fixture(scope="module")
def upstream() -> Iterator[HostileUpstream]:
    with HostileUpstream(_route) as up:
        yield up


@pytest.fixture(scope="module")
def gateway(upstream: HostileUpstream) -> Iterator[procs.Service]:
    with procs.gateway("--upstream", upstream.url + "/v1") as g:
        yield g


def _body(api: str, kind: str, stream: bool = True) -> dict[str, Any]:
    if api == "chat":
        return {
            "model": "sim-model",
            "stream": stream,
            "messages": [{"role": "user", "content": kind}],
        }
    return {"model": "sim-model", "stream": stream, "prompt": kind}


class Got:
    """What the client read: status, the events in order (b"[DONE]", or the parsed JSON),
    the raw body, and how long the response took to end (s)."""

    def __init__(self, status: int, body: bytes, seconds: float) -> None:
        self.status = status
        self.body = body
        self.seconds = seconds
        self.events: list[Any] = []
        if status == 200:
            for ev in sse.SSEDecoder().feed(body):
                if not ev.comment:
                    self.events.append(sse.DONE if ev.data == sse.DONE else orjson.loads(ev.data))

    def texts(self) -> list[str]:
        """Each content event's text, in order (an error event is `!code`, [DONE] is `$`)."""
        out = []
        for ev in self.events:
            if ev == sse.DONE:
                out.append("$")
            elif "error" in ev:
                out.append("!" + str(ev["error"].get("code")))
            else:
                for ch in ev.get("choices") or ():
                    t = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                    if t:
                        out.append(t)
        return out


async def _post(gw: procs.Service, api: str, kind: str, stream: bool = True) -> Got:
    t0 = time.monotonic()
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s,
        s.post(gw.url + PATHS[api], json=_body(api, kind, stream)) as r,
    ):
        body = await r.read()
    return Got(r.status, body, time.monotonic() - t0)


def _no_crash(gw: procs.Service) -> None:
    out = gw.output()
    assert "Traceback" not in out, out[-3000:]
    assert "internal error" not in out.lower(), out[-3000:]


def _protocol_502(got: Got) -> None:
    assert got.status == 502, got.body
    err = orjson.loads(got.body)["error"]
    assert err["code"] == "upstream_protocol_error", err
    assert "internal" not in err["message"].lower()


APIS = pytest.mark.parametrize("api", ["chat", "text"])


@APIS
@pytest.mark.parametrize("kind", ["bad_one_write", "bad_own_chunk", "bad_unchunked"])
async def test_bad_event_mid_stream_ends_with_one_error_event(
    gateway: procs.Service, api: str, kind: str
) -> None:
    got = await _post(gateway, api, kind)
    assert got.status == 200
    # Every good event before the fault, in order; then the error; then nothing at all.
    assert got.texts() == ["a", "b", "!upstream_protocol_error"], got.body
    assert sse.DONE_EVENT not in got.body
    _no_crash(gateway)


@APIS
async def test_multiline_crlf_event_split_between_cr_and_lf_is_delivered(
    gateway: procs.Service, api: str
) -> None:
    got = await _post(gateway, api, "crlf_split")
    assert got.texts() == ["a", "crlf", "$"], got.body
    _no_crash(gateway)


@APIS
async def test_multiline_comment_stays_a_comment(gateway: procs.Service, api: str) -> None:
    # A comment block whose second line reads `: data: [DONE]` is one comment: re-sent with
    # that line's prefix lost it would end the client's stream early.
    got = await _post(gateway, api, "comment_block")
    assert got.texts() == ["a", "b", "$"], got.body
    _no_crash(gateway)


@APIS
@pytest.mark.parametrize("kind", ["inf_mid", "deep_mid", "framing_mid"])
async def test_malformed_bytes_mid_stream_are_a_protocol_error_event(
    gateway: procs.Service, api: str, kind: str
) -> None:
    got = await _post(gateway, api, kind)
    assert got.status == 200
    assert got.texts() == ["a", "!upstream_protocol_error"], got.body
    assert b"internal" not in got.body.lower()
    _no_crash(gateway)


@APIS
@pytest.mark.parametrize("kind", ["inf_first", "deep_first", "framing_first"])
async def test_malformed_body_before_first_token_is_one_error_event_not_retried(
    gateway: procs.Service, upstream: HostileUpstream, api: str, kind: str
) -> None:
    # A 200 stream starts at once (docs/config.md, hedging): broken bytes before any content
    # are the one error event, with nothing before or after it.
    before = upstream.requests
    got = await _post(gateway, api, kind)
    assert got.status == 200
    assert got.texts() == ["!upstream_protocol_error"], got.body
    assert upstream.requests - before == 1  # deterministic: asking again would not help
    _no_crash(gateway)


@APIS
async def test_switching_protocols_is_502_and_not_retried(
    gateway: procs.Service, upstream: HostileUpstream, api: str
) -> None:
    before = upstream.requests
    _protocol_502(await _post(gateway, api, "upgrade"))
    assert upstream.requests - before == 1
    _no_crash(gateway)


@APIS
@pytest.mark.parametrize("kind", ["after_done_one_write", "after_done_writes"])
async def test_done_ends_the_stream_at_once(gateway: procs.Service, api: str, kind: str) -> None:
    # The upstream sends an event and a second [DONE] after its [DONE], then holds the
    # connection open: the client gets one [DONE], nothing after it, and is let go at once.
    got = await _post(gateway, api, kind)
    assert got.texts() == ["a", "$"], got.body
    assert got.body.count(sse.DONE_EVENT) == 1
    assert got.seconds < 2.0
    _no_crash(gateway)


@APIS
@pytest.mark.parametrize("kind", ["unary_not_json", "unary_not_object", "unary_deep"])
async def test_unary_answer_not_a_json_object_is_502(
    gateway: procs.Service, api: str, kind: str
) -> None:
    _protocol_502(await _post(gateway, api, kind, stream=False))
    _no_crash(gateway)


@APIS
async def test_gateway_keeps_serving_after_hostile_answers(
    gateway: procs.Service, api: str
) -> None:
    for kind in ("bad_one_write", "framing_first", "after_done_writes", "good"):
        await _post(gateway, api, kind)
    got = await _post(gateway, api, "good")
    assert got.texts() == ["a", "b", "$"]
    _no_crash(gateway)


# -- a 1e400 met when merging for a slow reader ------------------------------------------------

WORDS = 3000


def _merge_route(req: dict[str, Any]) -> Reply:
    """Thousands of small events at once (a slow reader's queue merges them), one of which
    carries a field out of a double's range (accepted unchecked by the typed decode; found
    only when merging parses it), then more."""
    burst = b"".join(chat_chunk("w ") for _ in range(WORDS))
    bad = chat_chunk("bad ").replace(b'"model"', b'"x":1e400,"model"')
    # After an event that never merges (a role chunk), the bad one heads the next merged run,
    # whose template is parsed. (One joining a run is not parsed: its text is taken, the rest
    # of it dropped; see relay.Piece.join.)
    role = chat_chunk("").replace(b'"content":""', b'"role":"assistant"')
    bad = role + bad
    return sse_reply([burst, burst, bad + burst, chat_chunk("", "stop") + DONE])


def _slow_read(port: int) -> bytes:
    body = orjson.dumps({**_body("chat", "merge"), "max_tokens": 10000})
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    out = b""
    while chunk := s.recv(1024):
        out += chunk
        time.sleep(0.01)  # the client's own slowness (so the relay queues), not a sync
    s.close()
    return out


async def test_out_of_range_number_met_when_merging_is_a_protocol_error() -> None:
    with HostileUpstream(_merge_route) as up, procs.gateway("--upstream", up.url + "/v1") as g:
        got = Got(200, unchunk(await asyncio.to_thread(_slow_read, g.port)), 0)
        texts = got.texts()
        assert texts[-1] == "!upstream_protocol_error", texts[-5:]
        assert "$" not in texts
        # What came before the error is a prefix of the good text, in order.
        assert set("".join(texts[:-1]).split()) <= {"w"}
        _no_crash(g)


# -- the same rule on gRPC ---------------------------------------------------------------------


async def test_grpc_usage_counts_that_are_not_counts_are_ignored_not_a_500(
    upstream: HostileUpstream,
) -> None:
    """The gRPC front read the usage counts as they came (`int("x")`, a protobuf range
    error for 1e30): a 500 after the content. They are ignored, as on HTTP."""
    from tests.test_grpc_stream import Stream, _free_port, _request

    port = _free_port()
    with procs.gateway("--grpc-port", str(port), "--upstream", upstream.url + "/v1") as g:
        async with Stream(f"127.0.0.1:{port}") as st:
            await st.outbox.put(_request("u", "usage_bad"))
            await st.wait(lambda: st.finished("u"))
        kinds = st.kinds("u")
        assert kinds[-1] == "done" and "error" not in kinds, kinds
        assert st.text("u") == "a"
        _no_crash(g)


async def test_grpc_protocol_error_mid_stream_ends_the_request_with_its_error(
    upstream: HostileUpstream,
) -> None:
    from tests.test_grpc_stream import Stream, _free_port, _request

    port = _free_port()
    with procs.gateway("--grpc-port", str(port), "--upstream", upstream.url + "/v1") as g:
        async with Stream(f"127.0.0.1:{port}") as st:
            await st.outbox.put(_request("bad", "bad_one_write"))
            await st.wait(lambda: st.finished("bad"))
            await st.outbox.put(_request("good", "good"))  # the call itself goes on
            await st.wait(lambda: st.finished("good"))
        # Deltas up to the fault, then the one Error, nothing after it.
        kinds = st.kinds("bad")
        assert kinds[-1] == "error" and "done" not in kinds, kinds
        assert st.text("bad") == "ab"
        err = st.inbox["bad"][-1].error
        assert err.status == 502 and "internal" not in err.message.lower(), err
        assert st.kinds("good")[-1] == "done" and st.text("good") == "ab"
        _no_crash(g)
