"""An upstream's `/v1/models` answer, read for the fields the gateway reads: each entry's
`id` (the models it serves, upstream/http.py) and the fields that carry its context window
(context/windows.py), and nothing else.

The answer is up to 4 MiB (http.py MAX_MODELS_BYTES), asked for once a minute, and an
upstream may put any JSON in it. Parsed whole (orjson), it cost what it held: 248 ms of the
event loop for 4 MiB of entries each carrying a field of `[]`s, 144 ms for 1.4 M empty
entries. Decoded into these TypedDicts, msgspec skips every other field in C: 13 ms and 97
ms (what is left is one dict an entry: an entry past the first MAX_MODELS is still decoded,
since a longer list is read for its first ones, not refused). The dicts are the ones a whole
parse gives, holding only these keys, so their readers are unchanged.

A field read here holds a scalar in every real list; an answer with another value there
(an object as an `id`) is parsed whole only up to MAX_LENIENT_BYTES, and is otherwise no
answer (logged by the caller, asked again after MODELS_RETRY).
"""

from __future__ import annotations

from typing import Any, TypedDict

import msgspec
import orjson

from tokenpipe.answer_fields import MAX_LENIENT_BYTES

#: What a field read here may hold (anything else fails the typed decode).
Scalar = str | int | float | bool | None

#: The fields of an entry that carry the window the server runs with, in order of trust
#: (vLLM and tokenpipe local: `max_model_len`), and those of llama.cpp's `meta`: the keys of
#: `_Entry` and `_Meta` below.
WINDOW_FIELDS = ("context_window", "max_model_len", "context_length", "n_ctx")
META_WINDOW_FIELDS = ("n_ctx", "n_ctx_train")


class _Meta(TypedDict, total=False):
    n_ctx: Scalar
    n_ctx_train: Scalar


class _Entry(TypedDict, total=False):
    id: Scalar
    context_window: Scalar
    max_model_len: Scalar
    context_length: Scalar
    n_ctx: Scalar
    meta: _Meta | str | int | float | bool | None


class _Models(TypedDict, total=False):
    # An entry that is not an object is skipped by the readers, as a whole parse gave it.
    data: list[_Entry | str | int | float | bool | None] | Scalar


_decode = msgspec.json.Decoder(_Models).decode


def read(body: bytes) -> Any:
    """The answer's fields the gateway reads; None when it is of another shape and over
    MAX_LENIENT_BYTES. Raises ValueError when it is not JSON."""
    try:
        return _decode(body)
    except msgspec.ValidationError:  # another shape (or not an object at all)
        if len(body) > MAX_LENIENT_BYTES:
            return None
        return orjson.loads(body)  # (orjson.JSONDecodeError is a ValueError)
    except (msgspec.DecodeError, RecursionError):
        raise ValueError("not JSON") from None
