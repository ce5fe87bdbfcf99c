"""What a span reads of a non-streamed answer: the model the upstream names and the finish
reasons, without parsing the rest.

An answer is up to 64 MiB (upstream/http.py MAX_RESPONSE_BYTES), and parsed whole on the
event loop 57 MiB of `[]`s cost 5.0 s of CPU and 1.8 GiB (front/answer.py, which reads an
answer passed on as sent the same way). msgspec skips what a struct does not name without
building objects; each value read is decoded only if it is a string (the callers want
strings; a string is one object, whatever its length).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import orjson

#: Choices read for their finish reasons (the chat schema's bound on `n`); an answer with
#: more gives none.
MAX_CHOICES = 128


class _Choice(msgspec.Struct):
    finish_reason: msgspec.Raw = msgspec.Raw()


class _Answer(msgspec.Struct):
    model: msgspec.Raw = msgspec.Raw()
    choices: msgspec.Raw = msgspec.Raw()
    stop_reason: msgspec.Raw = msgspec.Raw()  # Anthropic's
    status: msgspec.Raw = msgspec.Raw()  # the Responses API's


_read_answer = msgspec.json.Decoder(_Answer).decode
_read_choices = msgspec.json.Decoder(
    Annotated[list[_Choice], msgspec.Meta(max_length=MAX_CHOICES)]
).decode


def _string(raw: msgspec.Raw) -> str | None:
    view = memoryview(raw)
    if view[:1] != b'"':
        return None
    try:
        value: str = orjson.loads(view)
    except orjson.JSONDecodeError:
        return None
    return value


def facts(body: bytes) -> tuple[str | None, list[str | None], tuple[str | None, ...]] | None:
    """(the answer's `model`, each choice's `finish_reason`, its `stop_reason` and `status`),
    each None when absent or not a string; None when the body is not a JSON object."""
    try:
        answer = _read_answer(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    choices: list[str | None] = []
    if len(answer.choices):
        try:
            choices = [_string(c.finish_reason) for c in _read_choices(answer.choices)]
        except (msgspec.DecodeError, RecursionError):  # not a list of objects, too many
            pass
    return _string(answer.model), choices, (_string(answer.stop_reason), _string(answer.status))
