"""`tokenpipe local` with the real model (Gemma 3 270M on llama.cpp): no stubs.

Outputs are kept short (a few dozen tokens) except where decoding must outlast the socket
buffers (the pause and cancellation tests); `ignore_eos` fixes those lengths.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import re
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests import procs
from tokenpipe import sse
from tokenpipe.engines.local.model import installed

pytestmark = [
    pytest.mark.local,
    # In CI the extra is installed by `make test`, so a missing model fails there, loudly.
    pytest.mark.skipif(
        not installed() and not os.environ.get("CI"), reason="the `local` extra is not installed"
    ),
]

_COMMENT = re.compile(r"^tokenpipe queue_ms=(\d+\.\d) prefill_ms=(\d+\.\d) decode_ms=(\d+\.\d)$")


@pytest.fixture(scope="module")
def local() -> Iterator[procs.Service]:
    with procs.Service("local", "--port", "0", "--ctx", "2048", name="local", timeout=120) as s:
        yield s


@pytest.fixture(scope="module")
def local_gateway(local: procs.Service) -> Iterator[procs.Service]:
    with procs.gateway("--upstream", local.url + "/v1") as g:
        yield g


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The model's own tokenizer, loaded apart from the server (vocabulary only)."""
    from llama_cpp import Llama

    from tokenpipe.engines.local.model import gguf_path

    return Llama(model_path=str(gguf_path()), vocab_only=True, verbose=False)


# -- helpers -------------------------------------------------------------------------------


class Reply:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.events = sse.SSEDecoder().feed(body) if b"data:" in body[:64] else []

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(e.data) for e in self.events if not e.comment and e.data != sse.DONE]

    @property
    def text(self) -> str:
        out = []
        for c in self.chunks:
            for ch in c["choices"]:
                out.append((ch.get("delta") or {}).get("content") or ch.get("text") or "")
        return "".join(out)


def post(
    base: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout: float = 60,
) -> Reply:
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})}
        )
        r = conn.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def record(local: procs.Service, rid: str, times: bool = False) -> dict[str, Any]:
    recs = get_json(f"{local.url}/local/stats?id={rid}&times={int(times)}")["records"]
    assert recs, f"no record for {rid}"
    return recs[-1]  # type: ignore[no-any-return]


def until(cond: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not met within {timeout} s"
        time.sleep(0.01)


class RawStream:
    """A streaming request on a plain socket with a small receive buffer, so that not calling
    recv really stops the reading (no client library buffering behind our back)."""

    def __init__(self, base: str, body: dict[str, Any], rid: str) -> None:
        u = urlsplit(base)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        self.sock.settimeout(60)
        self.sock.connect((u.hostname, u.port))
        payload = json.dumps(body).encode()
        self.sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nx-request-id: "
            + rid.encode()
            + b"\r\nContent-Length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )
        self.raw = b""

    @property
    def content_chunks(self) -> int:
        return self.raw.count(b'"delta":{"content":')

    def read_until(self, cond: Callable[[], bool]) -> None:
        while not cond():
            data = self.sock.recv(65536)
            assert data, "connection closed early"
            self.raw += data
            if b"\r\n\r\n" in self.raw:
                assert self.raw.startswith(b"HTTP/1.1 200"), self.raw[:600]

    def close(self) -> None:
        self.sock.close()


# -- tests ---------------------------------------------------------------------------------


def test_streamed_chat_through_the_gateway_returns_real_text_and_exact_usage(
    local: procs.Service, local_gateway: procs.Service, tokenizer: Any, openai_schemas: Any
) -> None:
    question = "Name three colors of the rainbow."
    rid = "usage-" + uuid.uuid4().hex[:8]
    r = post(
        local_gateway.url,
        "/v1/chat/completions",
        {
            "model": "gemma-3-270m",
            "stream": True,
            "max_tokens": 24,
            "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": question}],
        },
        {"x-request-id": rid},
    )
    assert r.status == 200, r.body
    assert r.events[-1].data == sse.DONE
    for chunk in r.chunks:
        openai_schemas.validate("CreateChatCompletionStreamResponse", chunk)
    text = r.text
    assert re.search(r"[A-Za-z]{3,}", text), f"no words in {text!r}"
    usage = next(c["usage"] for c in r.chunks if c.get("usage"))
    expected_prompt = tokenizer.tokenize(
        f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n".encode(),
        add_bos=True,
        special=True,
    )
    assert usage["prompt_tokens"] == len(expected_prompt)
    finish = [c["choices"][0]["finish_reason"] for c in r.chunks if c["choices"]][-1]
    assert 0 < usage["completion_tokens"] <= 24
    if finish == "length":
        assert usage["completion_tokens"] == 24
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The engine's own count for this request agrees with what reached the client.
    # (By request id, and the completed one: a hedge the gateway sent meanwhile has the same id.)
    recs = get_json(f"{local.url}/local/stats?id={rid}&times=0")["records"]
    [last] = [rec for rec in recs if rec["outcome"] == "completed"]
    assert last["completion_tokens"] == usage["completion_tokens"]
    assert last["prompt_tokens"] == usage["prompt_tokens"]
    # The timing comment passes through the gateway (SSE clients ignore it).
    comments = [e.data.decode() for e in r.events if e.comment]
    assert any(_COMMENT.match(c) for c in comments), comments


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_streams_validate_and_end_with_the_timing_comment_right_before_done(
    local: procs.Service, openai_schemas: Any, path: str
) -> None:
    body: dict[str, Any] = {
        "model": "gemma-3-270m",
        "stream": True,
        "max_tokens": 12,
        "ignore_eos": True,
    }
    if path == "/v1/completions":
        body["prompt"] = "The capital of France is"
    else:
        body["messages"] = [{"role": "user", "content": "Say hello."}]
    r = post(local.url, path, body)
    assert r.status == 200, r.body
    assert r.headers["content-type"].startswith("text/event-stream")
    assert [e.data for e in r.events[-1:]] == [sse.DONE]
    comment = r.events[-2]
    assert comment.comment
    m = _COMMENT.match(comment.data.decode())
    assert m, comment.data
    _queue_ms, prefill_ms, decode_ms = map(float, m.groups())
    assert prefill_ms > 0 and decode_ms > 0
    if path == "/v1/chat/completions":
        for chunk in r.chunks:
            openai_schemas.validate("CreateChatCompletionStreamResponse", chunk)
    else:
        assert all(c["object"] == "text_completion" for c in r.chunks)
    assert r.chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert r.text.strip()


def test_non_streamed_responses_carry_usage_and_the_timing_headers(
    local: procs.Service, tokenizer: Any
) -> None:
    prompt = "Once upon a time"
    r = post(
        local.url,
        "/v1/completions",
        {"model": "gemma-3-270m", "prompt": prompt, "max_tokens": 10, "ignore_eos": True},
    )
    assert r.status == 200, r.body
    body = r.json()
    assert body["usage"] == {
        "prompt_tokens": len(tokenizer.tokenize(prompt.encode())),
        "completion_tokens": 10,
        "total_tokens": len(tokenizer.tokenize(prompt.encode())) + 10,
    }
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["text"]
    assert float(r.headers["x-tokenpipe-queue-ms"]) >= 0
    assert float(r.headers["x-tokenpipe-prefill-ms"]) > 0
    assert float(r.headers["x-tokenpipe-decode-ms"]) > 0
    r = post(
        local.url,
        "/v1/chat/completions",
        {
            "model": "gemma-3-270m",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is 2+2?"}],
        },
    )
    assert r.status == 200, r.body
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"]
    assert "x-tokenpipe-decode-ms" in r.headers


def test_models_health_and_request_errors(local: procs.Service) -> None:
    models = get_json(local.url + "/v1/models")
    assert [m["id"] for m in models["data"]] == ["gemma-3-270m"]
    assert models["data"][0]["max_model_len"] == 2048  # --ctx, for context budgeting
    assert get_json(local.url + "/healthz")["status"] == "ok"
    r = post(local.url, "/v1/chat/completions", {"model": "m", "messages": "nope"})
    assert r.status == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(
        local.url,
        "/v1/chat/completions",
        {"model": "m", "max_tokens": 999_999, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # Sampling values out of their ranges are refused, naming the field (llama.cpp took them).
    hi = [{"role": "user", "content": "hi"}]
    for field, value in (
        ("top_p", -5),
        ("min_p", 100),
        ("top_k", 2**40),
        ("presence_penalty", 1e308),
        ("frequency_penalty", -3),
    ):
        body = {"model": "m", "max_tokens": 1, "messages": hi, field: value}
        r = post(local.url, "/v1/chat/completions", body)
        assert r.status == 400 and r.json()["error"]["param"] == field, (field, r.json())
    # A request id that could break the JSON or a header is replaced, not echoed.
    body = {"model": "m", "stream": True, "max_tokens": 1, "prompt": "Hi"}
    r = post(local.url, "/v1/completions", body, {"x-request-id": 'a"b'})
    assert r.status == 200 and r.chunks
    assert r.chunks[0]["id"].startswith("cmpl-") and '"' not in r.chunks[0]["id"]


def test_slow_reader_pauses_decoding_by_the_engines_own_token_timestamps(
    local: procs.Service,
) -> None:
    rid = "pause-" + uuid.uuid4().hex[:8]
    n = 160  # well past what the socket buffers hold (~50-80 chunks)
    stream = RawStream(
        local.url,
        {
            "model": "gemma-3-270m",
            "stream": True,
            "max_tokens": n,
            "ignore_eos": True,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Count from one to a thousand in words."}],
        },
        rid,
    )
    try:
        stream.read_until(lambda: stream.content_chunks >= 5)
        stopped_reading = time.monotonic()
        # The engine reports its decode thread blocked on the hand-off, and for a while.
        rec = until(
            lambda: (r := record(local, rid))["paused_now_ms"] >= 1000 and r,
            timeout=60,
            what="decode paused for 1 s",
        )
        assert rec["paused"] and rec["outcome"] == "running"
        k = rec["completion_tokens"]
        assert k < n, "decoding raced ahead of the reader"
        stream.read_until(lambda: b"data: [DONE]" in stream.raw)
    finally:
        stream.close()
    rec = record(local, rid, times=True)
    assert rec["outcome"] == "completed" and rec["completion_tokens"] == n
    times = rec["token_times"]
    assert len(times) == n
    # By the engine's own clock: token k-1 was decoded after the client stopped reading, and
    # nothing was decoded for at least the second the client read nothing; then decoding
    # went on to the end at its usual pace.
    pause = times[k] - times[k - 1]
    assert times[k - 1] >= stopped_reading
    assert pause >= 1.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.median(gaps) < pause / 2
    assert stream.content_chunks <= n


@pytest.mark.parametrize("via", ["direct", "gateway"])
def test_cancelled_stream_stops_decoding_and_the_next_request_starts_at_once(
    local: procs.Service, local_gateway: procs.Service, via: str
) -> None:
    rid = f"cancel-{via}-" + uuid.uuid4().hex[:8]
    n = 400
    base = local.url if via == "direct" else local_gateway.url
    stream = RawStream(
        base,
        {
            "model": "gemma-3-270m",
            "stream": True,
            "max_tokens": n,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
        },
        rid,
    )
    stream.read_until(lambda: stream.content_chunks >= 3)
    stream.close()

    def ended() -> dict[str, Any] | None:
        # By request id; if the gateway hedged, the hedge has the same id and fewer tokens.
        stats = get_json(f"{local.url}/local/stats?id={rid}&times=0")
        recs = stats["records"]
        if not recs or any(r["ended"] is None for r in recs) or stats["busy"]:
            return None
        return max(recs, key=lambda r: r["completion_tokens"])  # type: ignore[no-any-return]

    rec = until(ended, what="the cancelled generation to end")
    assert rec["outcome"] == "cancelled"
    assert rec["completion_tokens"] < n / 2
    r = post(local.url, "/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 2})
    assert r.status == 200
    assert float(r.headers["x-tokenpipe-queue-ms"]) < 100, "the model was not freed"


def test_full_queue_answers_503_with_retry_after_and_the_waiter_gets_the_model_next() -> None:
    with procs.Service(
        "local", "--port", "0", "--ctx", "1024", "--max-queue", "1", name="local-q1", timeout=120
    ) as local:
        holder = RawStream(
            local.url,
            {
                "model": "gemma-3-270m",
                "stream": True,
                "max_tokens": 600,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "Write a long essay."}],
            },
            "holder",
        )
        try:
            holder.read_until(lambda: holder.content_chunks >= 1)  # it has the model
            waited: list[Reply] = []
            waiter = threading.Thread(
                target=lambda: waited.append(
                    post(
                        local.url,
                        "/v1/completions",
                        {"model": "m", "prompt": "Hi", "max_tokens": 2},
                    )
                )
            )
            waiter.start()
            until(
                lambda: get_json(local.url + "/local/stats?last=0")["waiting"] == 1,
                what="one request waiting",
            )
            r = post(local.url, "/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 2})
            assert r.status == 503
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["code"] == "queue_full" and err["type"] == "service_unavailable_error"
        finally:
            holder.close()  # client gone: the model goes to the waiter
        waiter.join(60)
        assert waited and waited[0].status == 200
        assert float(waited[0].headers["x-tokenpipe-queue-ms"]) > 0


def test_serve_without_an_upstream_runs_the_local_model_and_stops_it_on_exit() -> None:
    with procs.Service(
        "serve", "--port", "0", "--grpc-port", "0", name="gateway-default", timeout=120
    ) as gw:
        r = post(
            gw.url,
            "/v1/chat/completions",
            {
                "model": "gemma-3-270m",
                "max_tokens": 4,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )
        assert r.status == 200, r.body
        assert r.json()["usage"]["completion_tokens"] == 4
        m = re.search(r"local model \(Gemma 3 270M\) at (http://[\d.]+:\d+)/v1", gw.output())
        assert m, gw.output()
        child = m.group(1)
        assert get_json(child + "/healthz")["status"] == "ok"

    # The gateway is gone, and with it the child: its port refuses connections.
    def refused() -> bool:
        try:
            get_json(child + "/healthz")
        except (urllib.error.URLError, ConnectionError):
            return True
        return False

    until(refused, timeout=15, what="the local child to stop")


def test_a_paced_reader_slows_decoding_to_its_pace_through_the_gateway(
    local: procs.Service, local_gateway: procs.Service
) -> None:
    """The pace a client asks the gateway for reaches generation: the engine decodes at that
    pace (its own token timestamps), instead of racing ahead into buffers."""
    rid = "paced-" + uuid.uuid4().hex[:8]
    n, rate = 24, 8.0  # tokens, tokens/s: far below what the model decodes here
    r = post(
        local_gateway.url,
        "/v1/chat/completions",
        {
            "model": "gemma-3-270m",
            "stream": True,
            "max_tokens": n,
            "ignore_eos": True,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Count from one to a hundred."}],
        },
        {"x-request-id": rid, "x-tokenpipe-max-tokens-per-second": str(rate)},
    )
    assert r.status == 200 and b"data: [DONE]" in r.body
    times = record(local, rid, times=True)["token_times"]
    assert len(times) == n
    # Decoding n tokens at the pace takes about (n - 1 - handoff) / rate: the first few fill the
    # 4-token hand-off at once, the rest wait for the reader. Unpaced it takes well under 2 s.
    span = times[-1] - times[0]
    assert span >= (n - 1 - 5) / rate * 0.9, span


def test_gateway_passes_the_engines_timing_headers_through(
    local_gateway: procs.Service,
) -> None:
    r = post(
        local_gateway.url,
        "/v1/completions",
        {"model": "gemma-3-270m", "prompt": "Once upon a time", "max_tokens": 4},
    )
    assert r.status == 200, r.body
    assert float(r.headers["x-tokenpipe-queue-ms"]) >= 0
    assert float(r.headers["x-tokenpipe-prefill-ms"]) > 0
    assert float(r.headers["x-tokenpipe-decode-ms"]) > 0
