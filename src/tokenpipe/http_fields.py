"""What the front's HTTP/1.1 server (front/server.py) and the upstream client
(upstream/connection.py) share about the bytes httptools hands them: a head's header fields
decoded at once, and what a buffered piece of a body costs besides its bytes."""

from __future__ import annotations

from functools import partial

from multidict import CIMultiDict

#: What a buffered piece costs besides its bytes (a small bytes object's header and its slot
#: in a queue), counted against a buffer's watermarks: 2-byte pieces held ~20x their bytes.
PIECE_BYTES = 40

_latin1 = partial(bytes.decode, encoding="latin-1")


def decoded(names: list[bytes], values: list[bytes]) -> CIMultiDict[str]:
    """Header names and values (latin-1, as HTTP/1.1 has them) as a case-blind dict, by C
    calls alone: no bytecode a header (a header decoded in its callback cost ~20
    instructions more, and clients send ~15 headers, upstreams ~25)."""
    return CIMultiDict(zip(map(_latin1, names), map(_latin1, values), strict=True))
