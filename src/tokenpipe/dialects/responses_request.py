"""A Responses API request, checked, and translated into a chat completion request for an
upstream that does not serve /v1/responses (`upstreams[].responses: chat`, the default).

What the translation carries: `input` (a string, or message items whose parts are
`input_text`/`output_text`/`input_image` by URL, and `function_call`/`function_call_output`
items), `instructions` (a system message first), function `tools`, `tool_choice`,
`parallel_tool_calls`, `max_output_tokens` (-> max_tokens), `temperature`, `top_p`, `stream`,
`text.format` (-> response_format), `text.verbosity`, `reasoning.effort` (-> reasoning_effort)
and the identifiers chat knows too (`user`, `safety_identifier`, `prompt_cache_key`,
`prompt_cache_retention`, `service_tier`). Accepted and not sent: `metadata` (echoed in the
Response), `truncation` (the gateway's own context budget applies), `store: false`,
`stream_options.include_obfuscation` (no padding is added). Anything else, or a value the chat
API cannot express, is a 400 naming the field: nothing is dropped silently.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from tokenpipe.dialects.openai_schema import (
    MAX_MESSAGES,
    ModelName,
    Object,
    Probability,
    Temperature,
    TokenCount,
)
from tokenpipe.errors import GatewayError


class ResponsesStreamOptions(Struct):
    include_obfuscation: bool | None = None
    #: tokenpipe extension: the rate (tokens/s) the client can render; the relay paces to it.
    max_tokens_per_second: Annotated[float, Meta(ge=0, le=1e6)] | None = None


class ResponsesRequest(Struct):
    """The fields of a Responses request the gateway reads (the rest is left as sent)."""

    model: ModelName
    #: Items: as many as a chat request's messages (each item is at most one message). 4 MiB
    #: holds 140,000 small ones: translated into chat messages (89 ms of the event loop), they
    #: were refused by chat's bound only then, and passed on natively with no bound at all.
    input: str | Annotated[list[Object], Meta(max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None


#: Copied to the chat request under the same name.
_SAME = (
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "stream",
)
#: Read by the translation itself (or echoed only).
_TRANSLATED = (
    "input",
    "instructions",
    "max_output_tokens",
    "tools",
    "tool_choice",
    "text",
    "reasoning",
    "metadata",
    "truncation",
    "store",
    "stream_options",
)
#: Accepted only while unset or off (null, false, []): chat has no way to do them.
_ONLY_UNSET = (
    "previous_response_id",
    "conversation",
    "prompt",
    "background",
    "include",
    "max_tool_calls",
    "top_logprobs",
    "context_management",
    "moderation",
    "prompt_cache_options",
)
_KNOWN = frozenset(_SAME + _TRANSLATED + _ONLY_UNSET)
_SAME_SET = frozenset(_SAME)
_ONLY_UNSET_SET = frozenset(_ONLY_UNSET)
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _refuse(param: str, why: str) -> GatewayError:
    return GatewayError(
        400,
        f"'{param}' {why}: this upstream is reached through chat completions "
        "(upstreams[].responses: chat), which cannot express it.",
        code="unsupported_parameter",
        param=param,
    )


def to_chat(obj: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request for the Responses request `obj` (validated already as a
    ResponsesRequest). Raises a 400 GatewayError naming the first field it cannot carry."""
    # One pass over the client's fields, not one over each list of names (~140 bytecodes
    # a request, not ~400): an unknown field is refused first, then the first set that chat
    # cannot carry.
    chat: dict[str, Any] = {}
    refused = None
    for key, value in obj.items():
        if key in _SAME_SET:
            if value is not None:
                chat[key] = value
        elif key not in _KNOWN:
            name = key[:64]  # the client's own key, echoed: it may be megabytes long
            raise GatewayError(
                400, f"Unknown parameter: '{name}'.", code="unknown_parameter", param=name
            )
        elif refused is None and key in _ONLY_UNSET_SET and value not in (None, False, []):
            refused = key
    if refused is not None:
        raise _refuse(refused, "is not supported")
    if obj.get("store"):
        raise _refuse("store", "is not supported (the gateway stores no responses)")
    if obj.get("truncation") not in (None, "auto", "disabled"):
        raise GatewayError(400, "'truncation' must be 'auto' or 'disabled'.", param="truncation")
    messages: list[dict[str, Any]] = []
    if obj.get("instructions"):
        messages.append({"role": "system", "content": obj["instructions"]})
    source = obj.get("input")
    if source is None:
        raise GatewayError(400, "Missing required parameter: 'input'.", param="input")
    if isinstance(source, str):
        messages.append({"role": "user", "content": source})
    else:
        for i, item in enumerate(source):
            _item(messages, item, i)
    if not messages:
        raise GatewayError(400, "'input' holds no message.", param="input")
    chat["messages"] = messages
    if obj.get("max_output_tokens") is not None:
        chat["max_tokens"] = obj["max_output_tokens"]
    if obj.get("tools"):
        if not isinstance(obj["tools"], list):
            raise GatewayError(400, "'tools' must be a list.", param="tools")
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(obj["tools"])]
    if obj.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(obj["tool_choice"])
    _text(chat, obj.get("text"))
    _reasoning(chat, obj.get("reasoning"))
    opts = obj.get("stream_options")
    if isinstance(opts, dict):
        for key in opts:
            if key not in ("include_obfuscation", "max_tokens_per_second"):
                raise _refuse(f"stream_options.{key}", "is not supported")
    return chat


def _item(messages: list[dict[str, Any]], item: Any, i: int) -> None:
    """`input[i]` onto `messages`. Its place's name is written only when it is needed (an
    error, a content of several parts): a client resends every earlier item each turn, and
    the names, with a text part's list built only to be unpacked, were half the
    translation's time (31 items, timeit: 22.2 -> 9.7 us with string contents, 31.2 -> 15.7
    with one text part each)."""
    if not isinstance(item, dict):
        raise GatewayError(400, f"'input[{i}]' must be an object.", param=f"input[{i}]")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        role = _ROLES.get(role) if isinstance(role, str) else None
        if role is None:
            raise _refuse(f"input[{i}].role", f"= {item.get('role')!r} is not a chat role")
        content = item.get("content")
        if not isinstance(content, str):
            text = _sole_text(content)
            content = text if text is not None else _content(content, f"input[{i}]")
        messages.append({"role": role, "content": content})
        return
    where = f"input[{i}]"
    if kind == "function_call":
        call = {
            "id": _string(item, "call_id", where),
            "type": "function",
            "function": {
                "name": _string(item, "name", where),
                "arguments": _string(item, "arguments", where),
            },
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # one turn's calls, one message
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            output = _content(output, f"{where}.output")
        messages.append(
            {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output}
        )
    else:
        raise _refuse(f"{where}.type", f"= {kind!r} is not supported")


def _string(item: dict[str, Any], key: str, where: str, part: int | None = None) -> str:
    """`item[key]`, a string; `part`: the item is `where`'s content part of that index."""
    value = item.get(key)
    if not isinstance(value, str):
        at = where if part is None else f"{where}.content[{part}]"
        raise GatewayError(400, f"'{at}.{key}' must be a string.", param=f"{at}.{key}")
    return value


def _sole_text(content: Any) -> str | None:
    """The text of a content that is one text part (as the SDKs send a message's), else None:
    what `_content` gives for it, without its list of parts."""
    if type(content) is list and len(content) == 1:
        part = content[0]
        if type(part) is dict and part.get("type") in _TEXT_PARTS:
            text = part.get("text")
            if type(text) is str:
                return text
    return None


_TEXT_PARTS = ("input_text", "output_text")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string stays one; text parts become one string when there is
    one, chat text parts otherwise; images by URL become image_url parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(
            400, f"'{where}.content' must be a string or a list.", param=f"{where}.content"
        )
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": _string(part, "text", where, j)})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image = {"url": part["image_url"]}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise _refuse(f"{where}.content[{j}].type", f"= {kind!r} is not supported")
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise _refuse(f"{where}.type", f"= {kind!r} is not supported (function tools are)")
    function = {"name": _string(tool, "name", where)}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}
    raise _refuse("tool_choice", f"= {choice!r} is not supported")


def _text(chat: dict[str, Any], text: Any) -> None:
    if text is None:
        return
    if not isinstance(text, dict):
        raise GatewayError(400, "'text' must be an object.", param="text")
    for key, value in text.items():
        if key == "verbosity":
            if value is not None:
                chat["verbosity"] = value
        elif key != "format":
            raise _refuse(f"text.{key}", "is not supported")
    fmt = text.get("format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        assert isinstance(fmt, dict)
        schema = {"name": _string(fmt, "name", "text.format")}
        for key in ("schema", "strict", "description"):
            if fmt.get(key) is not None:
                schema[key] = fmt[key]
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        raise _refuse("text.format.type", f"= {kind!r} is not supported")


def _reasoning(chat: dict[str, Any], reasoning: Any) -> None:
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise GatewayError(400, "'reasoning' must be an object.", param="reasoning")
    for key, value in reasoning.items():
        if key == "effort":
            if value is not None:
                chat["reasoning_effort"] = value
        elif value is not None:
            raise _refuse(f"reasoning.{key}", "is not supported")
