"""Large answers from a hostile upstream, end to end: the gateway a process in front of a
scripted upstream (tests/hostile_upstream.py). A Responses stream translated from chat holds
its output for its last events, up to responses_output.HELD_MAX_BYTES: past it the stream
ends with an `error` event, never a `response.completed` missing part of the output. A
non-streamed answer passed on as sent is read for its `usage` only, not parsed whole (57 MiB
of `[]`s cost 1.8 GiB and 5 s of the event loop); a translation's is bounded at
front/answer.TRANSLATED_MAX_BYTES."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests import procs
from tests.hostile_upstream import DONE, HostileUpstream, Reply, chat_chunk, json_reply, sse_reply
from tests.polling import metrics, until
from tests.responses_events import check_events, check_response, parse, text_of
from tests.test_api_responses import sample
from tests.test_front_edge import _peak_rss
from tests.test_hostile_stream import _no_crash
from tokenpipe.dialects.responses_output import HELD_MAX_BYTES
from tokenpipe.front.answer import TRANSLATED_MAX_BYTES

DELTA = 64 * 1024  # characters of one content delta
USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


def _text(size: int) -> str:
    """`size` characters in DELTA-sized deltas, each numbered (a piece out of order shows)."""
    n = size // DELTA
    return "".join(f"{i:06d}" + "a" * (DELTA - 6) for i in range(n))


def _stream(size: int) -> Reply:
    text = _text(size)
    deltas = b"".join(chat_chunk(text[i : i + DELTA]) for i in range(0, len(text), DELTA))
    return sse_reply([deltas, chat_chunk("", "stop") + DONE])


def _answer(content: str, junk: int = 0) -> bytes:
    """A chat completion; `junk`: bytes of `[]`s in a field no one reads."""
    obj = {
        "id": "x",
        "object": "chat.completion",
        "model": "sim-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        "usage": USAGE,
    }
    body = orjson.dumps(obj)
    if junk:
        body = body[:-1] + b',"x":[' + b",".join([b"[]"] * (junk // 3)) + b"]}"
    return body


JUNK = 20 << 20  # bytes of `[]`s: parsed whole, ~600 MiB and ~2 s of the event loop
#: Scenario (the request's text, or the Responses input) -> the upstream's answer.
SCRIPTS: dict[str, Callable[[], Reply]] = {
    "stream_fits": lambda: _stream(HELD_MAX_BYTES - 16 * DELTA),
    "stream_over": lambda: _stream(HELD_MAX_BYTES + 16 * DELTA),
    "unary_fits": lambda: json_reply(_answer(_text(TRANSLATED_MAX_BYTES - 16 * DELTA))),
    "unary_over": lambda: json_reply(_answer(_text(TRANSLATED_MAX_BYTES + 16 * DELTA))),
    "junk_200": lambda: json_reply(_answer("ok", JUNK)),
    "bad_utf8": lambda: json_reply(_answer("ok").replace(b'"id":"x"', b'"id":"\xff\xfe"')),
    "junk_500": lambda: json_reply(
        _answer("", JUNK).replace(b'"usage"', b'"error":{"message":"no"},"usage"'),
        b"500 Internal Server Error",
    ),
}


@cache
def _reply(name: str) -> Reply:
    """The scenario's answer, built once, when first asked (tens of MiB)."""
    return SCRIPTS[name]()


def _route(req: dict[str, Any]) -> Reply:
    if "messages" not in req:  # the gateway's own probe of POST /responses
        return json_reply(b'{"error": {"message": "no"}}', b"404 Not Found")
    content = req["messages"][-1]["content"]
    return _reply(content if isinstance(content, str) else content[0]["text"])


@pytest.fixture(scope="module")
def upstream() -> Iterator[HostileUpstream]:
    with HostileUpstream(_route) as up:
        yield up


@pytest.fixture
def gateway(upstream: HostileUpstream, tmp_path: Path) -> Iterator[procs.Service]:
    """Its own per test (its peak memory is the test's). Streams get the kernel's send
    buffer: 16 KiB (the default) sends a few MB/s on loopback, and these are 20 MB."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "server: {stream_send_buffer_bytes: 0}\n"
        f"upstreams:\n  - {{name: upstream0, url: '{upstream.url}/v1', models: [sim-model]}}\n"
    )
    with procs.gateway("--config", str(cfg)) as g:
        yield g


async def _post(gw: procs.Service, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.post(gw.url + path, json=body) as r:
        return r.status, await r.read()


async def test_a_translated_responses_stream_past_its_bound_ends_with_an_error_event(
    gateway: procs.Service,
) -> None:
    """Under HELD_MAX_BYTES the Response completes whole; past it the client gets the
    deltas in order, then the `error` event, and no `response.completed` (unbounded, the
    gateway held the whole output: 48 MiB of text cost 368 MiB a stream)."""
    body = {"model": "sim-model", "input": "stream_fits", "stream": True}
    status, got = await _post(gateway, "/v1/responses", body)
    assert status == 200
    events = parse(got)
    check_events(events)
    sent = _text(HELD_MAX_BYTES - 16 * DELTA)
    assert events[-1]["type"] == "response.completed"
    assert check_response(events[-1]["response"]).output_text == sent

    status, got = await _post(gateway, "/v1/responses", {**body, "input": "stream_over"})
    assert status == 200
    events = parse(got)
    check_events(events)  # strictly increasing sequence numbers, one terminal event: last
    assert events[-1]["type"] == "error", events[-1]["type"]
    assert events[-1]["code"] == "upstream_protocol_error"
    assert f"passed {HELD_MAX_BYTES} bytes" in events[-1]["message"]
    assert "The answer is incomplete" in events[-1]["message"]
    text = text_of(events)
    assert _text(HELD_MAX_BYTES + 16 * DELTA).startswith(text)  # what came is all in order
    assert HELD_MAX_BYTES - 2 * DELTA < len(text) <= HELD_MAX_BYTES
    _no_crash(gateway)


async def test_a_translated_answer_past_its_bound_is_a_502(gateway: procs.Service) -> None:
    """A translation parses the answer whole: bounded at TRANSLATED_MAX_BYTES, not 64 MiB."""
    status, got = await _post(
        gateway, "/v1/responses", {"model": "sim-model", "input": "unary_fits"}
    )
    assert status == 200, got[:300]
    sent = _text(TRANSLATED_MAX_BYTES - 16 * DELTA)
    assert check_response(orjson.loads(got)).output_text == sent
    status, got = await _post(
        gateway, "/v1/responses", {"model": "sim-model", "input": "unary_over"}
    )
    assert status == 502, got[:300]
    assert orjson.loads(got)["error"]["code"] == "upstream_response_too_large"
    _no_crash(gateway)


@pytest.mark.parametrize(("kind", "status"), [("junk_200", 200), ("junk_500", 500)])
async def test_an_answer_passed_on_is_read_for_its_usage_not_parsed_whole(
    gateway: procs.Service, kind: str, status: int
) -> None:
    """20 MiB of `[]`s in a field the gateway does not read: the answer (or error) goes to
    the client as sent and its usage counts, and the gateway's peak memory grows by a few
    copies of the body, not by the ~600 MiB of its objects."""
    labels = {"api": "chat", "model": "sim-model", "upstream": "upstream0"}
    before = _peak_rss(gateway.pid)
    body = {"model": "sim-model", "messages": [{"role": "user", "content": kind}]}
    got_status, got = await _post(gateway, "/v1/chat/completions", body)
    assert got_status == status
    assert got == _reply(kind).pieces[0]  # as the upstream sent it
    assert _peak_rss(gateway.pid) - before < 5 * JUNK
    if status == 200:

        async def counted() -> bool:
            now = await metrics(gateway)
            return sample(now, "tokenpipe_tokens_total", **labels, kind="prompt") == 11

        await until(counted, 5, "the answer's usage counted")
    _no_crash(gateway)


async def test_an_answer_passed_on_that_is_not_utf8_is_a_502(gateway: procs.Service) -> None:
    """The read for `usage` skips the rest without checking its text: bytes that are not
    UTF-8 in a field it skips are still not JSON, and not passed on as an answer."""
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "bad_utf8"}]}
    status, got = await _post(gateway, "/v1/chat/completions", body)
    assert status == 502, got[:300]
    assert orjson.loads(got)["error"]["code"] == "upstream_protocol_error"
    _no_crash(gateway)
