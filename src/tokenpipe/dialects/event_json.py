"""An upstream's event or answer, read for the fields a reader acts on, at the cost of its
bytes.

An upstream may send any JSON: in an event of up to 4 MiB (sse.py), or in a non-streamed
answer a translation reads (4 MiB, front/answer.py). Parsed whole, JSON costs what it
builds, not what it weighs: an event with a 4 MiB field of `[]`s took orjson 170-240 ms of
the event loop, held from every other stream (benchmarks/hostile_cost.py `event:` and
`answer:`). msgspec, decoding into a type of the fields a reader reads, skips the rest in C
without building anything: 8 ms for the same event. So each reader decodes into a type:
- fields that are only passed on or tested for presence (`tool_calls` where only their
  presence counts) are `msgspec.Raw`: the JSON as sent, never built; an object passed on
  (chat's `logprobs`) is an `Opaque` struct, whose fields are skipped;
- objects the gateway reads whole (`usage`, `error`) are `Raw` too, and built by `object_of`
  only up to answer_fields.MAX_VALUE_BYTES, 64 KiB (a real one is under 1 KiB);
- JSON the gateway writes again unchanged (a tool's input, a tool call's arguments) is
  checked and written as it came (`fragment`), never built;
- the rest (text, reasons, indexes) typed as the API says, its lists bounded (MAX_ITEMS).

An event whose fields have other types than these fails the typed decode; the reader then
reads it `lenient`ly, parsed whole, taking what it can and passing the rest on. Since that
builds every object, it is done only up to MAX_LENIENT_BYTES; a larger event of an unexpected
shape ends the stream as a protocol error (never a complete-looking answer with a piece
missing), a larger answer is a 502. Real events of that size are long text or a finished
Response's output, which their type reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import orjson

from tokenpipe import answer_fields, sse

#: Largest event or answer read whole when its typed decode fails (answer_fields.py).
MAX_LENIENT_BYTES = answer_fields.MAX_LENIENT_BYTES
#: Entries of a list a reader builds (tool calls in one delta or message, content blocks in
#: one answer): the bound of a request's messages (openai_schema.MAX_MESSAGES), far above
#: what a model emits at once, far below the 1.4 M empty objects 4 MiB holds (~100 ms to
#: build; 10,000 cost ~2 ms). Past it the event or answer is of another shape (see above).
MAX_ITEMS = 10_000
#: Largest event a merged one is rebuilt from (Piece.mergeable parses it whole): a larger
#: content delta is passed on as it came, unmerged.
MAX_TEMPLATE_BYTES = MAX_LENIENT_BYTES

#: A Raw field's default: msgspec gives this very object for a field the event leaves out, so
#: `field is ABSENT` is the per-event test.
ABSENT = msgspec.Raw()
NULL = msgspec.Raw(b"null")
#: Raw JSON that is absent, null or empty: a field that says nothing.
_NOTHING = (b"", b"null", b"[]", b"{}", b'""', b"false", b"0")


def not_json() -> sse.SSEProtocolError:
    return sse.SSEProtocolError("upstream sent an event that is not valid JSON")


def lenient(data: bytes, what: str = "event") -> dict[str, Any]:
    """The event (or answer: `what`) parsed whole, for a reader whose typed decode refused
    it; raises sse.SSEProtocolError past MAX_LENIENT_BYTES, or when it is not an object."""
    if len(data) > MAX_LENIENT_BYTES:
        raise sse.SSEProtocolError(
            f"upstream sent an {what} of {len(data)} bytes with a field of an unexpected type"
            f" (over {MAX_LENIENT_BYTES} bytes, only the API's shape is read)"
        )
    try:
        obj = orjson.loads(data)
    except (orjson.JSONDecodeError, RecursionError):  # e.g. 1e999: not a double
        raise not_json() from None
    if type(obj) is not dict:
        raise sse.SSEProtocolError(f"upstream sent an {what} that is not a JSON object")
    return obj


def answer(decode: Callable[[bytes], Any], body: bytes) -> dict[str, Any] | None:
    """A non-streamed answer decoded typed by `decode` (a TypedDict's: the plain dict of the
    fields a translation reads), else `lenient`ly; None when it is not JSON."""
    try:
        obj: dict[str, Any] = decode(body)
    except msgspec.ValidationError:
        return lenient(body, "answer")
    except (msgspec.DecodeError, RecursionError):
        return None
    return obj


def fragment(raw: msgspec.Raw) -> orjson.Fragment:
    """A Raw field written again as it came (orjson writes a Fragment's bytes as they are):
    an upstream's tool input passed on without building it."""
    return orjson.Fragment(bytes(raw))


def object_of(raw: msgspec.Raw) -> dict[str, Any] | None:
    """A Raw field's value if it is a JSON object of at most answer_fields.MAX_VALUE_BYTES,
    else None."""
    if memoryview(raw)[:1] != b"{":  # absent, null or not an object: nothing to decode
        return None
    value = answer_fields.value(raw)
    return value if type(value) is dict else None


def raw_object(value: Any) -> msgspec.Raw:
    """An object of a `lenient` read as the Raw field the typed read gives: ABSENT when it
    is not an object (or nests deeper than orjson writes)."""
    if type(value) is not dict:
        return ABSENT
    try:
        return msgspec.Raw(orjson.dumps(value))
    except orjson.JSONEncodeError:
        return ABSENT


class Opaque(msgspec.Struct, gc=False):
    """An object passed on unread: msgspec skips its fields and builds nothing of them. Cheaper
    to test per event than a Raw (`is None`) where the API's value is an object or null."""


def is_null(raw: msgspec.Raw) -> bool:
    """A Raw field that is absent or null."""
    return raw is ABSENT or raw == NULL


def says_something(raw: msgspec.Raw) -> bool:
    """A Raw field's presence as a decoded value's truth: absent, null and empty are False.
    Whitespace inside (`[ ]`) counts as something, which only a pretty-printing upstream
    writes; a reader acting on it then treats the field as set."""
    return raw is not ABSENT and (len(raw) > 5 or bytes(raw) not in _NOTHING)
