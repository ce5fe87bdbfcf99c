"""Reads the metadata (key/value) section of a GGUF file, and nothing else.

Hand-written on purpose: the `gguf` package's GGUFReader parses every array into numpy objects,
which for Gemma 3's 262,144-entry vocabulary took 43 s here; we need a dozen scalars, so this
reader keeps scalars and small arrays and skips past large ones. Format: GGUF v2/v3,
little-endian (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import IO, Any

#: Arrays longer than this are skipped (their value becomes None): vocabularies, merges.
MAX_ARRAY = 4096
#: A key or string longer than this means a corrupt file, not metadata (bytes).
MAX_STRING = 1 << 24

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    pass


def read_metadata(path: str | Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file")
        (version,) = _unpack(f, "<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        _tensors, count = _unpack(f, "<QQ")
        meta: dict[str, Any] = {"GGUF.version": version}
        for _ in range(count):
            key = _string(f)
            (vtype,) = _unpack(f, "<I")
            meta[key] = _value(f, vtype)
        return meta


def _unpack(f: IO[bytes], fmt: str) -> tuple[Any, ...]:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFError("GGUF file ends inside its metadata")
    return struct.unpack(fmt, data)


def _string(f: IO[bytes]) -> str:
    (n,) = _unpack(f, "<Q")
    if n > MAX_STRING:
        raise GGUFError("GGUF string length out of range")
    return f.read(n).decode("utf-8", errors="replace")


def _value(f: IO[bytes], vtype: int) -> Any:
    if vtype in _SCALARS:
        return _unpack(f, _SCALARS[vtype])[0]
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        etype, n = _unpack(f, "<IQ")
        if n <= MAX_ARRAY:
            return [_value(f, etype) for _ in range(n)]
        if etype in _SCALARS:
            f.seek(n * struct.calcsize(_SCALARS[etype]), 1)
        elif etype == _STRING:
            for _ in range(n):
                (length,) = _unpack(f, "<Q")
                f.seek(length, 1)
        else:
            raise GGUFError("GGUF nested arrays are not supported")
        return None
    raise GGUFError(f"GGUF value type {vtype} is unknown")
