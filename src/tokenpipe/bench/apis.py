"""The client APIs the load generator speaks: one request (`ChatRequest`: a prompt and its
settings), and per API its endpoint, its body and headers, and the recorder of its stream
(`Wire`). `chat` is OpenAI's chat completions (the reference), `responses` OpenAI's Responses
API, `messages` Anthropic's Messages API. Their streams are read by `stream.StreamRecorder`
(chat) and `events.py` (the other two)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from tokenpipe.bench.events import MessagesRecorder, ResponsesRecorder
from tokenpipe.bench.metrics import RequestRecord
from tokenpipe.bench.stream import StreamRecorder

APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}
#: What a Messages request without max_tokens asks for (Anthropic requires the field); the
#: gateway's default when it translates a chat request onto Anthropic.
MESSAGES_MAX_TOKENS = 4096
#: The `anthropic-version` header the Anthropic SDKs send.
ANTHROPIC_VERSION = "2023-06-01"


@dataclass(slots=True)
class ChatRequest:
    """One prompt to send; `body()` is its chat completions body (the reference API, kept
    as it was), `responses_body`/`messages_body` the other APIs'."""

    model: str
    messages: list[dict[str, str]]
    max_tokens: int | None = None
    temperature: float | None = None
    #: Extra headers (e.g. x-sim-* for the sim); HTTP only.
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> bytes:
        obj: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.max_tokens is not None:
            obj["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            obj["temperature"] = self.temperature
        return orjson.dumps(obj)


def check(api: str) -> str:
    if api not in APIS:
        raise ValueError(f"unknown API {api!r}: use one of {', '.join(APIS)}")
    return api


def api_url(api: str, url: str) -> str:
    """The endpoint of `api` from a base URL (`http://h:p`, `http://h:p/v1`) or itself."""
    path = PATHS[check(api)]
    u = url.rstrip("/")
    if u.endswith(path):
        return u
    if u.endswith("/v1"):
        return u + path
    return u + "/v1" + path


def auth_headers(api: str, api_key: str | None) -> dict[str, str]:
    """The key as the API's SDK sends it (`x-api-key` for Messages, as Anthropic's does; the
    gateway accepts it there), and Anthropic's version header."""
    if api == "messages":
        key = {"x-api-key": api_key} if api_key else {}
        return {"anthropic-version": ANTHROPIC_VERSION, **key}
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def responses_body(req: ChatRequest) -> bytes:
    """The prompt's messages as Responses `input` message items, streamed."""
    obj: dict[str, Any] = {"model": req.model, "input": req.messages, "stream": True}
    if req.max_tokens is not None:
        obj["max_output_tokens"] = req.max_tokens
    if req.temperature is not None:
        obj["temperature"] = req.temperature
    return orjson.dumps(obj)


def messages_body(req: ChatRequest) -> bytes:
    """The prompt as a Messages request, streamed: system messages move to `system`."""
    system = [m["content"] for m in req.messages if m.get("role") == "system"]
    messages = [m for m in req.messages if m.get("role") != "system"]
    max_tokens = req.max_tokens if req.max_tokens is not None else MESSAGES_MAX_TOKENS
    obj: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
    }
    if system:
        obj["system"] = "\n\n".join(system)
    if req.temperature is not None:
        obj["temperature"] = req.temperature
    return orjson.dumps(obj)


_BODIES: dict[str, Callable[[ChatRequest], bytes]] = {
    "chat": ChatRequest.body,
    "responses": responses_body,
    "messages": messages_body,
}
_RECORDERS: dict[str, Callable[[RequestRecord], Any]] = {
    "chat": StreamRecorder,
    "responses": ResponsesRecorder,
    "messages": MessagesRecorder,
}


class Wire:
    """What one API's requests are made of, chosen once per client: the endpoint, the headers,
    the body of a request and the recorder of its stream."""

    __slots__ = ("body", "headers", "recorder", "url")

    def __init__(self, api: str, url: str, api_key: str | None) -> None:
        self.url = api_url(api, url)
        self.headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            **auth_headers(api, api_key),
        }
        self.body = _BODIES[api]
        self.recorder = _RECORDERS[api]
