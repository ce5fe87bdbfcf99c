"""The answer's head as the front writes it (front/wire.py `head_bytes`): one line per header,
and a value holding CR or LF dropped, never written (header injection: some values come from
upstreams and clients)."""

from __future__ import annotations

import re

import pytest

from tokenpipe.front.wire import head_bytes

_DATE = re.compile(rb"Date: [A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT\r\n")


def _lines(head: bytes) -> list[bytes]:
    assert head.endswith(b"\r\n\r\n")
    found = _DATE.findall(head)
    assert len(found) == 1
    return head.replace(found[0], b"")[:-4].split(b"\r\n")


def test_head_has_status_headers_and_length() -> None:
    head = head_bytes(200, {"Content-Type": "text/event-stream", "x-request-id": "r1"}, True, 5)
    assert _lines(head) == [
        b"HTTP/1.1 200 OK",
        b"Content-Type: text/event-stream",
        b"x-request-id: r1",
        b"Content-Length: 5",
    ]


def test_head_closes_and_names_unknown_status() -> None:
    assert _lines(head_bytes(599, {}, False)) == [b"HTTP/1.1 599 Unknown", b"Connection: close"]


@pytest.mark.parametrize("bad", ["a\r\nSet-Cookie: x=1", "a\nb", "a\rb", "\r\n", "a\r"])
def test_value_with_cr_or_lf_is_dropped(bad: str) -> None:
    head = head_bytes(429, {"a": "1", "x-upstream": bad, "b": "2"}, True)
    assert _lines(head) == [b"HTTP/1.1 429 Too Many Requests", b"a: 1", b"b: 2"]


def test_value_outside_latin1_is_replaced_not_raised() -> None:
    assert _lines(head_bytes(200, {"x": "caf\u00e9 \u2603"}, True))[1] == b"x: caf\xe9 ?"
