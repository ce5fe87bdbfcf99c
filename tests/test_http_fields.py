"""A head's header fields as both HTTP/1.1 ends decode them (http_fields.decoded): joined
on NUL, decoded at once and split, which holds only while llhttp refuses a NUL in a field."""

from __future__ import annotations

import httptools
import pytest

from tokenpipe.http_fields import decoded


def test_fields_are_decoded_in_order_with_empty_and_latin1_values_and_repeats() -> None:
    fields = [b"Host", b"a", b"X-Empty", b"", b"X-Latin", b"caf\xe9", b"set-cookie", b"1"]
    fields += [b"Set-Cookie", b"2", b"X-Last", b""]
    headers = decoded(fields)
    assert list(headers.items()) == [
        ("Host", "a"),
        ("X-Empty", ""),
        ("X-Latin", "café"),
        ("set-cookie", "1"),
        ("Set-Cookie", "2"),
        ("X-Last", ""),
    ]
    assert headers.getall("SET-COOKIE") == ["1", "2"]
    assert headers["x-latin"] == "café"
    assert len(decoded([])) == 0


_END = b"Content-Length: 0\r\n\r\n"


class _Fields:
    def __init__(self) -> None:
        self.fields: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields += (name, value)


@pytest.mark.parametrize(
    ("parser", "head"),
    [
        (httptools.HttpRequestParser, b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n"),
        (httptools.HttpRequestParser, b"GET / HTTP/1.1\r\nHost: a\r\nX\x00Y: b\r\n\r\n"),
        (httptools.HttpResponseParser, b"HTTP/1.1 200 OK\r\nX: a\x00b\r\n" + _END),
        (httptools.HttpResponseParser, b"HTTP/1.1 200 OK\r\nX\x00Y: b\r\n" + _END),
    ],
)
def test_no_field_httptools_delivers_holds_the_separator(parser: type, head: bytes) -> None:
    """The split's premise: a NUL in a name or a value is a parse error, never a field."""
    sink = _Fields()
    with pytest.raises(httptools.HttpParserError):
        parser(sink).feed_data(head)
    assert not any(b"\0" in f for f in sink.fields)
