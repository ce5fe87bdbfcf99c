"""The one SSE codec (server-sent events, as the OpenAI streaming API uses them).

Written by hand because the libraries (aiohttp-sse, sse-starlette, httpx-sse) are line-at-a-time
and allocate per line; here one `feed()` splits a whole socket read into events with `bytes.find`,
which keeps the per-token cost of the relay to a few operations.

Bytes are searched with `find`, never `in`: CPython 3.11's `needle in data` first tries the
needle as an int, so each test raises a TypeError, formats its message and clears it
(~1,900 machine instructions, against ~100 for `find`: benchmarks/request_instructions.py;
ten such tests ran a 1-token request). The dialects do the same.
"""

from __future__ import annotations

from typing import NamedTuple

DONE = b"[DONE]"


class Event(NamedTuple):
    data: bytes
    #: True for a comment line (`: text`), which SSE clients ignore; `data` then holds the text.
    comment: bool = False
    #: The `event:` field, if any (OpenAI does not send one; Anthropic does).
    event: str | None = None


class SSEProtocolError(Exception):
    pass


#: What a dialect's reading of an event raises when a value in the event's JSON has a type
#: its reading does not expect (`"index": [0]`, `"usage": "x"`, `"delta": "x"`): the
#: upstream's fault, made an SSEProtocolError (`shape_error`) like unparsable JSON, so the
#: stream ends with the protocol error (502), never a 500, a retry or a breaker's count.
SHAPE_ERRORS = (TypeError, AttributeError, KeyError, ValueError, IndexError)


def shape_error(e: Exception) -> SSEProtocolError:
    """The protocol error for `e`, one of SHAPE_ERRORS (its text bounded: it may quote the
    upstream's values)."""
    return SSEProtocolError(f"a value of an unexpected shape ({type(e).__name__}: {e!s:.80})")


def encode(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def encode_comment(text: bytes) -> bytes:
    return b": " + text + b"\n\n"


DONE_EVENT = encode(DONE)
#: Event(data) without the Python frame of a NamedTuple's generated `__new__` (per event).
_new_event = tuple.__new__


class SSEDecoder:
    """Incremental decoder. Bound: one event may be at most `max_event_bytes`; a longer one
    is a fault (an upstream sending that is broken or hostile): `feed` still returns the whole
    events before it, sets `fault`, and every later `feed` raises it.

    Line ends are LF, CRLF or CR (the SSE spec allows all three). A read that ends in CR keeps
    that CR back until the next read says whether an LF follows: normalised at once, a CRLF
    split between two reads would count as two line ends, i.e. an event boundary inside a
    multi-line event.

    An unterminated event's reads are added to a bytearray (amortised: each byte copied about
    once) and split only at a read that may end it: joined anew and split at every read, an
    event was copied again by each of its reads, so one of 4 MiB in 1 KiB reads (an upstream
    that dribbles, or a hostile one) cost 8.7 s of CPU (benchmarks/hostile_cost.py). Held as
    a list of reads instead, 2-byte reads would have held ~20x their bytes in objects."""

    __slots__ = ("_held", "fault", "max_event_bytes")

    def __init__(self, max_event_bytes: int = 4 * 1024 * 1024) -> None:
        self._held = bytearray()  # an unterminated event's bytes
        self.max_event_bytes = max_event_bytes
        self.fault: SSEProtocolError | None = None

    def feed_one(self, chunk: bytes) -> bytes | None:
        """The data of `chunk` if it is exactly one whole one-line `data:` event with nothing
        buffered before it (what a streaming LLM server sends per read), else None: use
        `feed`. A quarter of `feed`'s cost for the common case. After a fault, None (and
        `feed` raises it), as from `feed_many` and `feed_named`."""
        if self._held or self.fault is not None:
            return None
        if chunk.find(b"\n") != len(chunk) - 2 or chunk[-1:] != b"\n":
            return None
        if chunk[:6] != b"data: ":
            return None
        return chunk[6:-2]

    def feed_many(self, chunk: bytes) -> list[bytes] | None:
        """The data of each event of `chunk` if it holds nothing but whole one-line `data:`
        events (`data: ` then at least a byte) with nothing buffered before it, else None:
        use `feed`. What a server sends when a read catches up with several events (a
        request's last ones come together: content, finish, usage, `[DONE]`). Split by C
        calls over the whole read, not event by event: 4 events of ~200 bytes cost ~14,500
        machine instructions here, ~27,000 in `feed` (callgrind).

        Every LF of such a read is one of a separator's two or one of the last event's two,
        so no LF in any event's data proves none has a second line or another field; a CR
        (a line end too) sends the read to `feed`. The data are searched joined (memchr:
        ~0.01 ns a byte, ~0.1 us a read), not the read's LFs counted (bytes.count of one byte
        is a plain loop, ~0.3 ns a byte: 20,000 machine instructions of a 1-token Responses
        request, 2% of it)."""
        datas = self._whole(chunk, b"data: ", b"\n\ndata: ")
        if datas is None or b"" in datas or b"".join(datas).find(b"\n") >= 0:
            return None
        return datas

    def feed_named(
        self, chunk: bytes, raw: bool = True
    ) -> list[tuple[bytes, str, bytes | None]] | None:
        """The events of `chunk` if it holds nothing but whole two-line events, `event: `
        then `data: ` (the Responses and Messages APIs send nothing else), with nothing
        buffered before it, else None: use `feed`. As `feed_many`, split over the whole
        read: 4 Responses events of ~200 bytes cost ~68,000 machine instructions in `feed`
        (its field-by-field parse, written for any shape of event). No LF in an event's name
        or data (searched, as `feed_many`'s) proves it has no other line.

        Each event is (data, name, raw): `raw` its bytes as read, which a dialect passes on
        instead of writing them again (the read itself when it holds one event, as a token
        at speed does); None unless asked for (`raw`: a translation writes events of its
        own)."""
        blocks = self._whole(chunk, b"event: ", b"\n\nevent: ")
        if blocks is None:
            return None
        one = len(blocks) == 1
        events: list[tuple[bytes, str, bytes | None]] = []
        for block in blocks:
            name, _, data = block.partition(b"\ndata: ")
            if not data or data.find(b"\n") >= 0 or name.find(b"\n") >= 0:
                return None  # (`data: ` alone, a line of another field, or more lines)
            read = (chunk if one else b"event: " + block + b"\n\n") if raw else None
            events.append((data, name.decode("utf-8", "replace"), read))
        return events

    def _whole(self, chunk: bytes, first: bytes, between: bytes) -> list[bytes] | None:
        """`feed_many`'s and `feed_named`'s split: what follows the first line's field name
        (`first`, as `data: `) in each event of `chunk` (`between`: an event's end and the
        next one's `first`), if nothing is held, no fault was met, the read starts with
        `first`, ends an event and holds no CR; else None. The caller checks each event's
        lines."""
        if self._held or self.fault is not None:
            return None
        if chunk[: len(first)] != first or chunk[-2:] != b"\n\n" or chunk.find(b"\r") >= 0:
            return None
        return chunk[len(first) : -2].split(between)

    def feed(self, chunk: bytes) -> list[Event]:
        if self.fault is not None:
            raise self.fault
        held = self._held
        seen = 0  # bytes at the start of `buf` known to hold no blank line (LF LF)
        if held:
            # Two line ends in a row (an event's end) hold LF LF, CR CR or LF CR, whatever
            # the line ends; the held bytes' last one may be the first of them, and their
            # last two may be LF CR already (a CR held back: see above).
            if not (_two_ends(chunk) or _two_ends(held[-2:] + chunk[:1])):
                if len(held) + len(chunk) > self.max_event_bytes:
                    self._too_large()
                else:
                    held += chunk
                return []
            seen = len(held) - 1  # (its last LF may start one with the read's first)
            held += chunk
            buf = bytes(held)
            self._held = bytearray()
        else:
            buf = chunk
        cr = b""
        if buf.find(b"\r") >= 0:
            if buf[-1:] == b"\r":  # maybe the first half of a CRLF: decided by the next read
                buf, cr = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            seen = 0  # (the held bytes' CRs are line ends too)
        # A long event's end is searched for past what was held (a two-byte search costs
        # 55 us a 64 KiB: 3.4 ms of a 4 MiB event's last read).
        end = buf.find(b"\n\n", seen) if seen > 64 * 1024 else -1
        blocks = [buf[:end], *buf[end + 2 :].split(b"\n\n")] if end >= 0 else buf.split(b"\n\n")
        rest = blocks.pop() + cr  # after the last blank line: an unterminated event
        events: list[Event] = []
        for block in blocks:
            # Fast path: the one-line `data: {...}` that OpenAI-compatible servers send.
            if block[:6] == b"data: " and block.find(b"\n") < 0:
                if len(block) > 6:  # `data: ` alone has no data: no event (the spec)
                    events.append(_new_event(Event, (block[6:], False, None)))
            elif block:
                ev = _parse_block(block)
                if ev is not None:
                    events.append(ev)
        if len(rest) > self.max_event_bytes:
            self._too_large()
        elif rest:
            self._held = bytearray(rest)
        return events

    def _too_large(self) -> None:
        self.fault = SSEProtocolError(f"SSE event larger than {self.max_event_bytes} bytes")
        self._held = bytearray()

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated (non-empty at EOF means a truncated stream)."""
        return bytes(self._held)


def _two_ends(data: bytes | bytearray) -> bool:
    # Most reads of a long event hold no line end at all: one byte is found by memchr
    # (0.7 us for 64 KiB), two by a slower search (55 us each, three of them: 10 ms of the
    # 63 reads before a 4 MiB event's last, benchmarks/hostile_events.py).
    if data.find(b"\n") < 0 and data.find(b"\r") < 0:
        return False
    return data.find(b"\n\n") >= 0 or data.find(b"\r\r") >= 0 or data.find(b"\n\r") >= 0


def _parse_block(block: bytes) -> Event | None:
    data: list[bytes] = []
    comment: list[bytes] = []
    event: str | None = None
    for line in block.split(b"\n"):
        if not line:
            continue
        if line[0:1] == b":":
            comment.append(line[1:].lstrip(b" "))
            continue
        field, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            event = value.decode("utf-8", "replace")
        # `id:` and `retry:` are not used by LLM APIs; ignored as the SSE spec allows.
    if data:
        joined = b"\n".join(data)
        # The spec dispatches no event whose data is empty (`data:` alone).
        return Event(joined, False, event) if joined else None
    if comment:
        return Event(b"\n".join(comment), True, event)
    return None
