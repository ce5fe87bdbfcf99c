"""What the front's HTTP/1.1 server (front/server.py) and the upstream client
(upstream/connection.py) share about the bytes httptools hands them: a head's header fields
decoded at once, and what a buffered piece of a body costs besides its bytes."""

from __future__ import annotations

from multidict import CIMultiDict

#: What a buffered piece costs besides its bytes (a small bytes object's header and its slot
#: in a queue), counted against a buffer's watermarks: 2-byte pieces held ~20x their bytes.
PIECE_BYTES = 40

#: Joins a head's fields to decode them in one call. llhttp (httptools) refuses a NUL in a
#: header's name or value, so no field holds one and the split gives back every field.
_SEP = b"\0"


def decoded(fields: list[bytes]) -> CIMultiDict[str]:
    """Header fields, delivered as [name, value, name, value, ...] (a value may be empty),
    decoded (latin-1, as HTTP/1.1 has them) into a case-blind dict. Joined, decoded and split
    in three C calls, then handed to CIMultiDict as a list: a zip iterator takes its slow
    path (timeit, 8 fields: 1.3 us against 0.5). The whole is 2.3 us against 6.5 for a
    decode a field through `partial(bytes.decode, encoding=...)`, which builds its keyword
    arguments at each call."""
    if not fields:
        return CIMultiDict()
    text = _SEP.join(fields).decode("latin-1").split("\0")
    return CIMultiDict(list(zip(text[::2], text[1::2], strict=True)))
