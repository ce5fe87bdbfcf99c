"""The HTTP/1.1 contract of the gateway's client-facing front, pinned over raw loopback
sockets against a real gateway and a real sim, so that it holds whichever server implements
the front (front/server.py on httptools; aiohttp's web server before it): pipelining, HTTP/1.0
clients, `Expect: 100-continue` with a chunked body, HEAD, bounds on the request head, an
oversized body, keep-alive, and the deadline on a connection's head.

Every read has a deadline and waits for a condition (an answer complete, an EOF), never for a
fixed time. The answers are parsed by the small strict HTTP/1.1 reader below, which is
independent of the server's parser. Five of these failed on aiohttp's front (RFC 9110/9112:
100 Continue sent for a body already known to be over the limit, 400 for an over-long request
target instead of 414, an HTTP/1.0 rejection without `Connection: close`, an oversized body
read for 10 s after its 413).
"""

from __future__ import annotations

import json
import re
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import procs

#: Longest wait for one answer (generous: a busy 2-core machine).
ANSWER_SECONDS = 15.0
#: server.read_timeout_seconds of the `quick` gateway (the deadline on a connection's head).
HEAD_DEADLINE = 1.0
#: The latest a connection without a whole head may be closed (seconds after it opened).
CLOSE_BY = 5.0
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
STREAM = {**CHAT, "stream": True}


# --- a raw HTTP/1.1 client ---------------------------------------------------------------


@dataclass
class Answer:
    version: bytes  # b"HTTP/1.1"
    status: int
    headers: dict[str, str]  # lower-case names; a repeated one joined with ", "
    body: bytes
    chunked: bool = False
    close_delimited: bool = False  # no framing: the body ran until the server closed

    def json(self) -> Any:
        return json.loads(self.body)


_STATUS_LINE = re.compile(rb"(HTTP/1\.[01]) ([1-5]\d\d) [^\r\n]*")
_CHUNK_SIZE = re.compile(rb"[0-9a-fA-F]{1,16}")


def parse(buf: bytes | bytearray, eof: bool, *, head: bool = False) -> tuple[Answer, int] | None:
    """The first whole answer in `buf` and the bytes it took, or None while incomplete.
    Raises AssertionError on anything that is not HTTP/1.1 framing. `head`: the answer to a
    HEAD request (no body whatever its headers say)."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = bytes(buf[:end]).split(b"\r\n")
    pos = end + 4
    m = _STATUS_LINE.fullmatch(lines[0])
    assert m, f"not an HTTP/1.x status line: {lines[0][:200]!r}"
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        assert colon and name and name.strip() == name, f"bad header line {line[:200]!r}"
        key, val = name.decode("latin-1").lower(), value.strip(b" \t").decode("latin-1")
        headers[key] = f"{headers[key]}, {val}" if key in headers else val
    status = int(m[2])
    answer = Answer(m[1], status, headers, b"")
    if head or status < 200 or status in (204, 304):
        return answer, pos
    if "transfer-encoding" in headers:
        assert headers["transfer-encoding"].lower() == "chunked", headers
        assert "content-length" not in headers, headers  # RFC 9112 6.2: never both
        answer.chunked = True
        body = bytearray()
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size_field = bytes(buf[pos:eol]).split(b";", 1)[0].strip(b" \t")
            assert _CHUNK_SIZE.fullmatch(size_field), f"bad chunk size {buf[pos:eol][:80]!r}"
            size = int(size_field, 16)
            pos = eol + 2
            if size == 0:
                while True:  # trailer section, up to its empty line
                    eol = buf.find(b"\r\n", pos)
                    if eol < 0:
                        return None
                    trailer, pos = buf[pos:eol], eol + 2
                    if not trailer:
                        answer.body = bytes(body)
                        return answer, pos
            if len(buf) < pos + size + 2:
                return None
            body += buf[pos : pos + size]
            assert buf[pos + size : pos + size + 2] == b"\r\n", "a chunk not ended by CRLF"
            pos += size + 2
    if "content-length" in headers:
        assert headers["content-length"].isdigit(), headers
        length = int(headers["content-length"])
        if len(buf) < pos + length:
            return None
        answer.body = bytes(buf[pos : pos + length])
        return answer, pos + length
    if not eof:
        return None
    answer.body, answer.close_delimited = bytes(buf[pos:]), True
    return answer, len(buf)


class Wire:
    """One client connection: raw bytes out, a buffer of what came back, reads with a
    deadline. `eof`: the server closed (FIN, or a reset: `reset`)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_SECONDS)
        self.opened = time.monotonic()
        self.buf = bytearray()
        self.eof = False
        self.reset = False
        self.closed_at: float | None = None

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> bool:
        """False if the server had already closed (or reset) the connection."""
        self.sock.settimeout(ANSWER_SECONDS)
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def fill(self, deadline: float) -> None:
        """One read into the buffer, waiting at most until `deadline`."""
        assert not self.eof, "read after the server closed"
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(1 << 16)
        except ConnectionResetError:
            chunk, self.reset = b"", True
        if not chunk:
            self.eof, self.closed_at = True, time.monotonic()
        self.buf += chunk

    def answer(self, seconds: float = ANSWER_SECONDS, *, head: bool = False) -> Answer:
        """The next whole answer; fails if none is complete within `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            parsed = parse(self.buf, self.eof, head=head)
            if parsed is not None:
                answer, used = parsed
                del self.buf[:used]
                return answer
            assert not self.eof, f"closed mid-answer (reset: {self.reset}): {self._seen()}"
            try:
                self.fill(deadline)
            except TimeoutError:
                raise AssertionError(f"no whole answer in {seconds:g} s: {self._seen()}") from None

    def until_closed(self, seconds: float) -> bytes:
        """Reads until the server closes; fails if it has not within `seconds`. Returns the
        bytes that came (and were not taken by `answer`) before the close."""
        deadline = time.monotonic() + seconds
        while not self.eof:
            try:
                self.fill(deadline)
            except TimeoutError:
                raise AssertionError(f"still open after {seconds:g} s: {self._seen()}") from None
        return bytes(self.buf)

    def _seen(self) -> str:
        return repr(bytes(self.buf[:300]))


def request(
    method: str,
    path: str,
    body: Any = None,
    *,
    version: str = "1.1",
    headers: tuple[str, ...] = (),
) -> bytes:
    """A request's bytes; `body` (a dict: JSON) with its Content-Length; a Host on 1.1."""
    lines = [f"{method} {path} HTTP/{version}"]
    if version == "1.1":
        lines.append("Host: 127.0.0.1")
    data = b""
    if body is not None:
        data = json.dumps(body).encode()
        lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    lines += headers
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def healthz_ok(port: int) -> None:
    """A new connection's /healthz answers 200: the gateway still serves."""
    with Wire(port) as w:
        w.send(request("GET", "/healthz", headers=("Connection: close",)))
        a = w.answer()
        assert (a.status, a.json()) == (200, {"status": "ok"})


def sse_text(body: bytes) -> str:
    """The text of a whole chat stream: `data:` events of chat.completion.chunk objects,
    the last one `[DONE]` and nothing after it."""
    assert body.endswith(b"\n\n"), body[-200:]
    events = []
    for event in body.split(b"\n\n")[:-1]:
        data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            events.append(b"\n".join(data))
    assert events and events[-1] == b"[DONE]", body[-300:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[-1]["finish_reason"], choices[-1]
    text = "".join(ch["delta"].get("content") or "" for ch in choices)
    assert text.strip(), body[:300]
    return text


def completion(a: Answer) -> str:
    assert a.status == 200, a
    assert a.headers["content-type"].startswith("application/json"), a.headers
    doc = a.json()
    assert doc["object"] == "chat.completion", doc
    content: str = doc["choices"][0]["message"]["content"]
    assert content.strip()
    return content


def json_4xx(a: Answer, sent: bytes) -> dict[str, Any]:
    """A 4xx OpenAI-shaped JSON error that quotes nothing of what the client sent."""
    assert 400 <= a.status < 500, a
    assert a.headers.get("content-type", "").startswith("application/json"), a.headers
    assert sent not in a.body and sent not in "\n".join(a.headers.values()).encode()
    err: dict[str, Any] = a.json()["error"]
    assert {"message", "type", "code"} <= set(err), err
    return err


# --- gateways ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gw(sim: procs.Service) -> Iterator[procs.Service]:
    """A gateway with the default settings (body limit 4 MiB, read timeout 30 s)."""
    with procs.gateway("--upstream", sim.url + "/v1") as g:
        yield g


@pytest.fixture(scope="module")
def quick(sim: procs.Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[procs.Service]:
    """A gateway whose clients must send their head within HEAD_DEADLINE."""
    cfg: Path = tmp_path_factory.mktemp("http11") / "gw.yaml"
    cfg.write_text(
        f"server:\n  read_timeout_seconds: {HEAD_DEADLINE}\n"
        f"upstreams:\n  - name: sim\n    url: {sim.url}/v1\n"
    )
    with procs.gateway("--config", str(cfg)) as g:
        yield g


# --- 1. pipelining -----------------------------------------------------------------------


def test_pipelined_requests_are_answered_whole_and_in_order(gw: procs.Service) -> None:
    """Four requests in one write (a GET, a completion, a stream, a GET): four whole
    answers in the order asked, and the connection is still usable after them."""
    with Wire(gw.port) as w:
        assert w.send(
            request("GET", "/healthz")
            + request("POST", "/v1/chat/completions", CHAT, headers=("x-request-id: pipe-2",))
            + request("POST", "/v1/chat/completions", STREAM, headers=("x-request-id: pipe-3",))
            + request("GET", "/readyz")
        )
        first = w.answer()
        assert (first.status, first.json()) == (200, {"status": "ok"})
        second = w.answer()
        completion(second)
        assert second.headers["x-request-id"] == "pipe-2"
        third = w.answer()
        assert third.status == 200 and third.headers["x-request-id"] == "pipe-3"
        assert third.headers["content-type"].startswith("text/event-stream")
        assert third.chunked, third.headers  # HTTP/1.1 with no length: chunked framing
        sse_text(third.body)
        fourth = w.answer()
        assert (fourth.status, fourth.json()) == (200, {"status": "ready"})
        for a in (first, second, third, fourth):
            assert a.version == b"HTTP/1.1"
            assert a.headers.get("connection", "keep-alive").lower() != "close", a.headers
        # Nothing stray after the fourth answer; the connection goes on, then closes on ask.
        assert w.send(request("GET", "/healthz", headers=("Connection: close",)))
        last = w.answer()
        assert last.status == 200
        assert w.until_closed(ANSWER_SECONDS) == b""


# --- 2. HTTP/1.0 -------------------------------------------------------------------------


def test_an_http10_request_is_answered_and_the_connection_closed(gw: procs.Service) -> None:
    with Wire(gw.port) as w:
        assert w.send(b"GET /healthz HTTP/1.0\r\n\r\n")  # no Host, no keep-alive
        a = w.answer()
        assert (a.status, a.json()) == (200, {"status": "ok"})
        assert a.version in (b"HTTP/1.0", b"HTTP/1.1")
        assert a.headers.get("connection", "close").lower() == "close", a.headers
        assert not a.chunked
        assert w.until_closed(ANSWER_SECONDS) == b""


def test_an_http10_stream_is_the_whole_sse_body_then_eof(gw: procs.Service) -> None:
    """An HTTP/1.0 client knows no chunked coding: the stream is the bare SSE bytes, ended
    by the close, with `data: [DONE]` as its last event."""
    with Wire(gw.port) as w:
        assert w.send(request("POST", "/v1/chat/completions", STREAM, version="1.0"))
        a = w.answer()
        assert a.status == 200, a
        assert a.version in (b"HTTP/1.0", b"HTTP/1.1")
        assert a.headers["content-type"].startswith("text/event-stream")
        assert "transfer-encoding" not in a.headers, a.headers
        assert a.close_delimited or "content-length" in a.headers, a.headers
        assert a.body.startswith((b"data:", b":", b"event:")), a.body[:100]  # no chunk sizes
        sse_text(a.body)
        assert w.eof or w.until_closed(ANSWER_SECONDS) == b""


# --- 3. Expect: 100-continue -------------------------------------------------------------


def test_expect_100_continue_then_a_chunked_body_gets_the_completion(gw: procs.Service) -> None:
    body = json.dumps(CHAT).encode()
    with Wire(gw.port) as w:
        assert w.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        interim = w.answer()  # the client sends nothing more until this arrives
        assert (interim.version, interim.status) == (b"HTTP/1.1", 100), interim
        assert w.buf == b"", bytes(w.buf)  # no final answer before the body
        for i in range(0, len(body), 17):
            piece = body[i : i + 17]
            assert w.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        assert w.send(b"0\r\n\r\n")
        completion(w.answer())
        # The chunked body was consumed to its end: the next request on it is answered.
        assert w.send(request("GET", "/healthz"))
        assert w.answer().status == 200


def test_a_body_in_two_byte_chunks_is_read_whole(gw: procs.Service) -> None:
    """Pieces this small are buffered with their objects' overhead counted and joined as
    read (a body of 2-byte chunks held ~20x its bytes as a list of pieces)."""
    body = json.dumps({**CHAT, "user": "u" * 20000}).encode()
    pieces = [body[i : i + 2] for i in range(0, len(body), 2)]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    with Wire(gw.port) as w:
        assert w.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunks
            + b"0\r\n\r\n"
        )
        completion(w.answer())


@pytest.mark.parametrize(
    "end", [b"0\r\nx-trailer: ", b"5;ext="], ids=["endless-trailer", "endless-chunk-extension"]
)
def test_a_chunked_body_with_endless_framing_is_refused(gw: procs.Service, end: bytes) -> None:
    """After a whole JSON body, a trailer (or a chunk extension) that never ends: the parser
    binding would join the trailer's pieces without bound while the handler waits for the
    body's end. Bytes that deliver nothing are bounded as a head is: a 431, then the close."""
    body = json.dumps(CHAT).encode()
    with Wire(gw.port) as w:
        assert w.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n" % (len(body), body)
            + end
        )
        for _ in range(64):  # 1 MiB; the server may answer and close before it has all
            if not w.send(FILLER * 5462):
                break
        a = w.answer()
        assert a.status == 431, a
        json_4xx(a, FILLER)
        w.until_closed(ANSWER_SECONDS)
    healthz_ok(gw.port)


def test_expect_100_continue_with_a_body_over_the_limit_gets_413_not_100(
    gw: procs.Service,
) -> None:
    with Wire(gw.port) as w:
        assert w.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n"
            b"Expect: 100-continue\r\n\r\n" % (64 << 20)
        )
        a = w.answer()
        assert a.status == 413, f"first answer {a.status}, not the final 413"
        assert json_4xx(a, b"sim-model")["code"] == "request_too_large"


# --- 4. HEAD -----------------------------------------------------------------------------


def test_head_has_the_headers_and_no_body(gw: procs.Service) -> None:
    with Wire(gw.port) as w:
        assert w.send(
            request("HEAD", "/healthz") + request("GET", "/healthz", headers=("Connection: close",))
        )
        head = w.answer(head=True)
        assert (head.version, head.status) == (b"HTTP/1.1", 200), head
        assert head.headers["content-type"].startswith("application/json")
        # The GET's answer follows the HEAD's head directly: not one body byte between.
        assert w.buf.startswith(b"HTTP/1.1 200") or not w.buf, bytes(w.buf[:100])
        get = w.answer()
        assert (get.status, get.json()) == (200, {"status": "ok"})
        if "content-length" in head.headers:  # RFC 9110 8.6: if sent, the GET's length
            assert int(head.headers["content-length"]) == len(get.body)
        assert w.until_closed(ANSWER_SECONDS) == b""


# --- 5. bounds on the head ---------------------------------------------------------------

FILLER = b"Zq7"  # what an echo of the client's bytes would show
OVER = 17 * 1024  # over the 16 KiB bound on the request line and on one header
HEADS = {
    "request line over 16 KiB": b"GET /healthz?pad=" + FILLER * (OVER // 3) + b" HTTP/1.1\r\n"
    b"Host: 127.0.0.1\r\n\r\n",
    "one header over 16 KiB": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: "
    + FILLER * (OVER // 3)
    + b"\r\n\r\n",
    "200 headers": b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    + b"".join(b"X-Pad-%d: %s\r\n" % (i, FILLER) for i in range(200))
    + b"\r\n",
}


def _rejected(port: int, data: bytes) -> Answer:
    """The answer to an over-bound head, after which the server closes the connection."""
    with Wire(port) as w:
        w.send(data)  # the server may answer and close before it has read all of it
        a = w.answer()
        w.until_closed(ANSWER_SECONDS)
        return a


@pytest.mark.parametrize("case", list(HEADS))
def test_a_head_over_its_bounds_is_a_json_4xx_then_close(gw: procs.Service, case: str) -> None:
    a = _rejected(gw.port, HEADS[case])
    json_4xx(a, FILLER)
    healthz_ok(gw.port)


def test_heads_within_the_bounds_are_served(gw: procs.Service) -> None:
    """The bounds are not lower than ordinary clients need: an 8 KiB request line, an 8 KiB
    header, three of them (each line within its bound, together over it) and 64 headers are
    answered, on one kept-alive connection."""
    pad = b"v" * 8192
    heads = [
        b"GET /healthz?pad=%s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" % pad,
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: %s\r\n\r\n" % pad,
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + b"".join(b"X-Pad-%d: %s\r\n" % (i, pad) for i in range(3))
        + b"\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + b"".join(b"X-Pad-%d: v\r\n" % i for i in range(63))
        + b"\r\n",
    ]
    with Wire(gw.port) as w:
        for data in heads:
            assert w.send(data)
            a = w.answer()
            assert (a.status, a.json()) == (200, {"status": "ok"}), data[:60]


@pytest.mark.parametrize("case", ["one header over 16 KiB", "200 headers"])
def test_headers_over_their_bounds_are_431(gw: procs.Service, case: str) -> None:
    a = _rejected(gw.port, HEADS[case])  # RFC 6585 5: Request Header Fields Too Large
    assert a.status == 431, a.status


def test_a_request_target_over_the_bound_is_414(gw: procs.Service) -> None:
    a = _rejected(gw.port, HEADS["request line over 16 KiB"])
    assert a.status == 414, a.status
    json_4xx(a, FILLER)


@pytest.mark.parametrize("case", ["one header over 16 KiB", "200 headers"])
def test_a_rejected_http11_head_is_answered_in_http11_with_connection_close(
    gw: procs.Service, case: str
) -> None:
    a = _rejected(gw.port, HEADS[case])
    assert a.version == b"HTTP/1.1", a.version
    assert a.headers.get("connection", "").lower() == "close", a.headers


# --- 6. a body over the limit ------------------------------------------------------------

BIG = 64 << 20  # a Content-Length of 64 MiB; the limit (server.max_body_bytes) is 4 MiB
PIECE = b"x" * 65536


def _big_post(w: Wire) -> Answer:
    """Sends the head and the first 64 KiB of a 64 MiB body; the 413 must come before more
    is sent (a server that waited for the whole body would never answer here)."""
    assert w.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % BIG + PIECE
    )
    a = w.answer()
    assert a.status == 413, a
    assert json_4xx(a, PIECE[:64])["code"] == "request_too_large"
    return a


def test_a_body_over_the_limit_is_a_413_before_it_is_read(gw: procs.Service) -> None:
    with Wire(gw.port) as w:
        _big_post(w)
    healthz_ok(gw.port)


def test_a_body_over_the_limit_is_not_read_and_the_connection_closes(
    gw: procs.Service,
) -> None:
    with Wire(gw.port) as w:
        a = _big_post(w)
        sent = len(PIECE)
        deadline = w.opened + CLOSE_BY
        closed = False
        while not closed and sent < BIG and time.monotonic() < deadline:
            # The client keeps sending, at most 64 KiB per 10 ms (6.4 MB/s: the whole body
            # would take over 10 s), and sees the close as it comes.
            readable, _, _ = select.select([w.sock], [], [], 0.01)
            if readable:
                w.fill(deadline)
                closed = w.eof
                continue
            w.sock.settimeout(0)
            try:
                sent += w.sock.send(PIECE[: BIG - sent])
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                closed = True  # and the close seen on the send
        took = time.monotonic() - w.opened
        assert closed, f"still open after {took:.1f} s and {sent} bytes of the body"
        assert sent < BIG
        assert a.headers.get("connection", "").lower() == "close", a.headers
    healthz_ok(gw.port)


# --- 7. keep-alive -----------------------------------------------------------------------


def test_fifty_sequential_requests_on_one_kept_alive_connection(gw: procs.Service) -> None:
    """Streams (chunked), completions and GETs, one after another on one connection: all
    answered, none says `Connection: close`, the server never closes it."""
    with Wire(gw.port) as w:
        for i in range(50):
            kind = i % 5
            if kind == 0:
                assert w.send(request("POST", "/v1/chat/completions", STREAM)), i
                a = w.answer()
                assert a.status == 200 and a.chunked, (i, a.headers)
                sse_text(a.body)
            elif kind == 1:
                assert w.send(request("POST", "/v1/chat/completions", CHAT)), i
                completion(a := w.answer())
            elif kind == 2:
                assert w.send(request("GET", "/v1/models")), i
                a = w.answer()
                assert a.status == 200 and a.json()["object"] == "list", (i, a)
            else:
                path, status = ("/healthz", "ok") if kind == 3 else ("/readyz", "ready")
                assert w.send(request("GET", path)), i
                a = w.answer()
                assert (a.status, a.json()) == (200, {"status": status}), i
            assert a.version == b"HTTP/1.1"
            assert a.headers.get("connection", "").lower() != "close", (i, a.headers)
            assert not w.eof, f"closed after request {i}"
        assert w.buf == b""


# --- 8. the deadline on a connection's head ----------------------------------------------


def test_a_kept_alive_connection_outlives_the_head_deadline_but_a_head_begun_on_it_does_not(
    quick: procs.Service,
) -> None:
    """The idle keep-alive (server.keepalive_seconds, 75 s by default) is not the deadline on
    a head (read_timeout_seconds, here 1 s). Before they were one: a connection idle longer
    than the head deadline was closed, below a load balancer's own idle timeout (AWS's ALB:
    60 s against the default read timeout of 30), which then sent requests into the close."""
    with Wire(quick.port) as w:
        assert w.send(request("GET", "/healthz"))
        assert w.answer().status == 200
        readable, _, _ = select.select([w.sock], [], [], 2 * HEAD_DEADLINE)  # idle, past it
        assert not readable, f"closed while idle: {w.until_closed(0.1)!r}"
        assert w.send(request("GET", "/healthz"))  # served on the same connection
        assert w.answer().status == 200
        assert w.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # half a head
        begun = time.monotonic()
        w.until_closed(CLOSE_BY)
        assert w.closed_at is not None
        assert HEAD_DEADLINE * 0.8 <= w.closed_at - begun < CLOSE_BY


def test_an_idle_kept_alive_connection_is_closed_after_keepalive_seconds(
    sim: procs.Service, tmp_path: Path
) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"server:\n  keepalive_seconds: 0.5\nupstreams:\n  - name: sim\n    url: {sim.url}/v1\n"
    )
    with procs.gateway("--config", str(cfg)) as g, Wire(g.port) as w:
        assert w.send(request("GET", "/healthz"))
        assert w.answer().status == 200
        answered = time.monotonic()
        assert w.until_closed(CLOSE_BY) == b""  # (the read timeout, 30 s, would be later)
        assert w.closed_at is not None and w.closed_at - answered >= 0.4


def test_a_connection_without_a_whole_head_is_closed_at_the_deadline_meanwhile_others_served(
    quick: procs.Service,
) -> None:
    """Connections that send nothing, half a request line or half a head are closed after
    server.read_timeout_seconds (here 1 s), with nothing sent (or a 408 for a half head);
    meanwhile a stream longer than that deadline runs to its end on another connection, and
    a third, kept alive, gets a /healthz answered for each event of that stream."""
    silent = Wire(quick.port)
    half_line = Wire(quick.port)
    half_head = Wire(quick.port)
    assert half_line.send(b"GET /heal")
    assert half_head.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    waiting = [silent, half_line, half_head]
    streamer = Wire(quick.port)
    slow = {**STREAM, "max_tokens": 20}
    slow["messages"] = [{"role": "user", "content": "[[sim itl_ms=100]] hi"}]  # ~2 s
    assert streamer.send(request("POST", "/v1/chat/completions", slow))
    busy = Wire(quick.port)
    asked = answered = 0
    stream: Answer | None = None
    stream_took = 0.0
    deadline = time.monotonic() + CLOSE_BY + ANSWER_SECONDS
    try:
        while time.monotonic() < deadline and (
            stream is None or asked > answered or not all(w.eof for w in waiting)
        ):
            socks = [w for w in [*waiting, streamer, busy] if not w.eof]
            readable, _, _ = select.select([w.sock for w in socks], [], [], 0.5)
            for w in socks:
                if w.sock in readable:
                    w.fill(deadline)
            while (got := parse(busy.buf, busy.eof)) is not None:
                a, used = got
                del busy.buf[:used]
                assert (a.status, a.json()) == (200, {"status": "ok"})
                answered += 1
            if stream is None and streamer.sock in readable:
                got = parse(streamer.buf, streamer.eof)
                if got is not None:
                    stream, stream_took = got[0], time.monotonic() - streamer.opened
                elif asked == answered:  # one /healthz per event of the stream
                    assert busy.send(request("GET", "/healthz")), "the busy one was closed"
                    asked += 1
            assert not busy.eof, "the kept-alive connection was closed"
            assert stream is not None or not streamer.eof, "the stream was cut"
        for w, name in zip(waiting, ["silent", "half line", "half head"], strict=True):
            assert w.eof and w.closed_at is not None, f"{name}: still open: {w._seen()}"
            took = w.closed_at - w.opened
            assert HEAD_DEADLINE * 0.8 <= took < CLOSE_BY, f"{name}: closed after {took:.2f} s"
            if w is silent:
                assert w.buf == b"", f"{name}: {w._seen()}"
            else:
                assert w.buf == b"" or w.buf.startswith((b"HTTP/1.1 408", b"HTTP/1.0 408")), (
                    f"{name}: {w._seen()}"
                )
        assert stream is not None, "the stream did not end"
        assert stream.status == 200
        sse_text(stream.body)
        assert stream_took > HEAD_DEADLINE, stream_took  # it ran across the deadline
        assert answered == asked >= 5, (asked, answered)
    finally:
        for w in [*waiting, streamer, busy]:
            w.sock.close()
