"""What the gateway reads of a non-streamed answer, in one pass: `usage` and `error` for the
front and the books, the model and finish reasons for the span.

An answer is up to 64 MiB (upstream/http.py MAX_RESPONSE_BYTES). Parsed whole on the event
loop, 57 MiB of `[]`s cost 5.0 s of CPU and 1.8 GiB of peak RSS; read so, 0.13 s and nothing
beyond the body. (Parsed in a thread, it stalled the loop as long: orjson holds the GIL for
the whole parse.) msgspec checks the rest of the body (its syntax and nesting; not numbers
past a double's range, which JSON allows) and skips it without building objects. The fields
are kept as raw JSON and decoded when asked: an object only up to MAX_VALUE_BYTES, a string
whatever its length (one object; its callers cut it).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import orjson

#: Largest object value decoded (`usage`, `error`; a real one is under 1 KiB): a larger one
#: counts as absent, like one of the wrong type.
MAX_VALUE_BYTES = 64 * 1024
#: Largest upstream JSON parsed whole when it is not in its API's shape (bytes): an event or
#: answer a reader could not decode typed (dialects/event_json.py), a /models answer
#: (upstream/model_list.py). 64 KiB of the costliest JSON (`[]`s) parses in ~2.6 ms.
MAX_LENIENT_BYTES = 64 * 1024
#: Choices read for their finish reasons (the chat schema's bound on `n`); an answer with
#: more gives none.
MAX_CHOICES = 128


class Fields(msgspec.Struct):
    usage: msgspec.Raw = msgspec.Raw()
    error: msgspec.Raw = msgspec.Raw()
    model: msgspec.Raw = msgspec.Raw()
    choices: msgspec.Raw = msgspec.Raw()
    stop_reason: msgspec.Raw = msgspec.Raw()  # Anthropic's
    status: msgspec.Raw = msgspec.Raw()  # the Responses API's


class _Choice(msgspec.Struct):
    finish_reason: msgspec.Raw = msgspec.Raw()


_read_fields = msgspec.json.Decoder(Fields).decode
_read_choices = msgspec.json.Decoder(
    Annotated[list[_Choice], msgspec.Meta(max_length=MAX_CHOICES)]
).decode


def read(body: bytes) -> Fields | None:
    """The fields of an answer that is a JSON object; None when it is not (not JSON, not an
    object, nested too deep, or text that is not UTF-8)."""
    try:
        fields = _read_fields(body)
        # msgspec does not check the text of what it skips: text that is not UTF-8 is not
        # JSON (a 502, as orjson's full parse made it). ASCII is UTF-8 (a scan, no copy);
        # else a decode: 0.08 ms a MiB, a copy of the body for that long.
        if not body.isascii():
            body.decode()
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return None
    return fields


def value(raw: msgspec.Raw) -> Any:
    """A field's value; None when absent, over MAX_VALUE_BYTES or not JSON orjson reads."""
    if not 0 < len(raw) <= MAX_VALUE_BYTES:
        return None
    try:
        return orjson.loads(memoryview(raw))
    except orjson.JSONDecodeError:  # a number out of a double's range
        return None


def string(raw: msgspec.Raw) -> str | None:
    """A field's value when it is a string, else None."""
    view = memoryview(raw)
    if view[:1] != b'"':
        return None
    try:
        text: str = orjson.loads(view)
    except orjson.JSONDecodeError:
        return None
    return text


def finish_reasons(fields: Fields) -> list[str | None]:
    """Each choice's `finish_reason` (None where it is not a string); none when `choices` is
    not a list of objects or holds more than MAX_CHOICES."""
    if not len(fields.choices):
        return []
    try:
        return [string(c.finish_reason) for c in _read_choices(fields.choices)]
    except (msgspec.DecodeError, RecursionError):
        return []
