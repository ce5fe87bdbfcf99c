"""The request bodies the local engine accepts, read with a size cap, and checked into the
sampling parameters one generation runs with (n, refusals, the context window, stop)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta

from tokenpipe.engines.local import refusals
from tokenpipe.engines.local.decode import SamplingParams
from tokenpipe.engines.local.model import MODEL_ID
from tokenpipe.errors import GatewayError, validation_field

#: Largest request body read (bytes); a longer one gets 413.
MAX_BODY = 4 * 1024 * 1024


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    #: The rate (tokens/s) the reader renders at; decoding is paced to it (see
    #: `LocalServer._stream`).
    max_tokens_per_second: float | None = None


# The sampling values' ranges, OpenAI's where it has the parameter (top_k and min_p are
# llama.cpp's: a share, and a count its C API takes as int32). Out of range: a 400 naming the
# field (before, top_p -5 or a penalty of 1e308 were passed to llama.cpp and answered 200).
Share = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]


class RequestBody(msgspec.Struct, kw_only=True):
    model: str = MODEL_ID
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: Share | None = None
    top_k: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    min_p: Share | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    ignore_eos: bool = False
    # Accepted only to be refused when they ask for what the model cannot do (refusals.py).
    tools: list[Any] | None = None
    tool_choice: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    response_format: Any = None


class ChatRequest(RequestBody, kw_only=True):
    messages: list[dict[str, Any]]


class CompletionRequest(RequestBody, kw_only=True):
    prompt: Any


async def read_request(request: web.Request, kind: type[Any]) -> Any:
    """The body decoded as `kind`; a GatewayError (413, 400) if it is too large or invalid."""
    body = await request.content.read(MAX_BODY + 1)
    if len(body) > MAX_BODY:
        raise GatewayError(413, f"Request body larger than {MAX_BODY} bytes.")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise GatewayError(400, f"Invalid request: {e}", param=validation_field(str(e))) from None
    except msgspec.DecodeError:
        raise GatewayError(400, "The request body is not valid JSON.") from None


def sampling_params(
    req: RequestBody, n_prompt: int, n_ctx: int, default_max_tokens: int
) -> SamplingParams:
    """What `req` asks the model for, given a prompt of `n_prompt` tokens and a context window
    of `n_ctx`; a GatewayError (400) for what the model cannot do or the window cannot hold."""
    if req.n not in (None, 1):
        raise GatewayError(400, "n must be 1 with the local model", param="n")
    refusals.check(
        tools=req.tools,
        tool_choice=req.tool_choice,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        response_format=req.response_format,
    )
    room = n_ctx - n_prompt
    if room <= 0:
        raise GatewayError(
            400,
            f"The prompt has {n_prompt} tokens; the local model's context window is {n_ctx}.",
            code="context_length_exceeded",
            param="messages",
        )
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room)
    if max_tokens < 0 or max_tokens > room:
        raise GatewayError(
            400,
            f"max_tokens must be between 0 and {room} (the context window "
            f"of {n_ctx} less {n_prompt} prompt tokens).",
            code="context_length_exceeded",
            param="max_tokens",
        )
    p = SamplingParams(max_tokens=max_tokens, seed=req.seed, ignore_eos=req.ignore_eos)
    if req.temperature is not None:
        if not 0 <= req.temperature <= 2:
            raise GatewayError(400, "temperature must be between 0 and 2", param="temperature")
        p.temperature = req.temperature
    if req.top_p is not None:
        p.top_p = req.top_p
    if req.top_k is not None:
        p.top_k = req.top_k
    if req.min_p is not None:
        p.min_p = req.min_p
    if req.presence_penalty is not None:
        p.presence_penalty = req.presence_penalty
    if req.frequency_penalty is not None:
        p.frequency_penalty = req.frequency_penalty
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    if len(stop) > 4:
        raise GatewayError(400, "at most 4 stop sequences", param="stop")
    p.stop = tuple(stop)
    return p
