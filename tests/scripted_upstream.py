"""In-process upstreams for router tests: each `post` answers with the next scripted answer, as
a real `UpstreamResponse` fed by hand (its `_feed`/`_end`), so the router reads, closes and
pushes exactly as it does on a socket. `FakeConn` stands in for the response's connection and
records what the response asks of it (an `abort` is the upstream seeing the request dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson
from multidict import CIMultiDict

from tokenpipe import sse
from tokenpipe.settings import Settings, UpstreamSettings
from tokenpipe.upstream.h1 import UpstreamResponse
from tokenpipe.upstream.http import HttpUpstream

MODEL = "m"


class FakeConn:
    """What an `UpstreamResponse` calls on its connection."""

    def __init__(self) -> None:
        self.aborted = False
        self.finished = False
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def abort(self) -> None:
        self.aborted = True

    def finish(self) -> None:
        self.finished = True


#: How a scripted body ends: True cleanly, False not at all (held open, as a stalled upstream
#: holds it), an exception: the connection broke after the chunks.
End = bool | BaseException


@dataclass
class Answer:
    status: int = 200
    chunks: list[bytes] = field(default_factory=list)
    end: End = True
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Sent:
    """One request an upstream received, and the response it got."""

    path: str
    body: bytes
    request_id: str
    stream: bool
    resp: UpstreamResponse
    conn: FakeConn

    @property
    def closed(self) -> bool:
        """The router is done with the response: closed, or read to its end. (A body held
        open reaches EOF only by `close`, which aborts its connection; a scripted body that
        ended has bytes, so it is at EOF only once closed or read.)"""
        return self.resp.at_eof()


def response(answer: Answer) -> tuple[UpstreamResponse, FakeConn]:
    conn = FakeConn()
    resp = UpstreamResponse(conn, answer.status, CIMultiDict(answer.headers), None)  # type: ignore[arg-type]
    for chunk in answer.chunks:
        resp._feed(chunk)
    if answer.end is True:
        resp._end(None)
    elif isinstance(answer.end, BaseException):
        resp._end(answer.end)
    return resp, conn


class ScriptedUpstream(HttpUpstream):
    """An upstream whose `post` answers from `answers`, in order (a send beyond them fails the
    test). `on_post(self)` runs as each request arrives, before it is answered."""

    def __init__(
        self,
        name: str,
        answers: list[Answer],
        *,
        continue_final_message: bool = False,
        on_post: Callable[[ScriptedUpstream], None] | None = None,
    ) -> None:
        super().__init__(
            msgspec.convert(
                {
                    "name": name,
                    "url": "http://127.0.0.1:9/v1",  # never dialled: `post` is replaced
                    "models": [MODEL],
                    "continue_final_message": continue_final_message,
                },
                UpstreamSettings,
            )
        )
        self.answers = list(answers)
        self.sent: list[Sent] = []
        self.on_post = on_post

    async def post(
        self,
        path: str,
        body: bytes,
        request_id: str,
        stream: bool = False,
        *,
        pace: float | None = None,
        trace: bytes = b"",
    ) -> UpstreamResponse:
        if self.on_post is not None:
            self.on_post(self)
        assert self.answers, f"upstream {self.name}: a send nobody scripted"
        resp, conn = response(self.answers.pop(0))
        self.sent.append(Sent(path, body, request_id, stream, resp, conn))
        return resp


def settings_for(upstreams: list[ScriptedUpstream], tail: dict[str, Any] | None = None) -> Settings:
    """Settings naming these upstreams (one limiter and breaker each), with a fixed
    concurrency limit and the given `tail` section."""
    return msgspec.convert(
        {
            "upstreams": [msgspec.to_builtins(u.settings) for u in upstreams],
            "limits": {"adaptive_concurrency": False, "max_concurrency": 4},
            "tail": tail or {},
        },
        Settings,
    )


# -- bodies ------------------------------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    obj = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


ROLE = chunk({"role": "assistant", "content": ""})


def content(text: str) -> bytes:
    return chunk({"content": text})


def stream(*texts: str, role: bool = True) -> list[bytes]:
    """A whole chat stream: the role chunk, one chunk per text, the finish, [DONE]."""
    return [*([ROLE] if role else []), *map(content, texts), chunk(None, "stop"), sse.DONE_EVENT]


def completion(text: str) -> bytes:
    msg = {"role": "assistant", "content": text}
    obj = {"id": "c1", "object": "chat.completion", "model": MODEL, "choices": [{"message": msg}]}
    return orjson.dumps(obj)


def error_body(status: int) -> bytes:
    return orjson.dumps({"error": {"message": f"scripted {status}", "type": "server_error"}})
