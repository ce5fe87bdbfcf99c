"""Finished spans as the bytes of an OTLP `ExportTraceServiceRequest`, written directly.

Why by hand: the exporters' encoder (opentelemetry-exporter-otlp-proto-common) builds a
protobuf object for every attribute, event and span, and each enclosing constructor copies
its children again (attribute into key-value, into span, into scope, into resource, into
request): with every request traced it was ~30% of the gateway's CPU, in the export thread,
which holds the GIL while it encodes (py-spy, benchmarks/relay_cost.py --tracing on). The
wire format of these few messages is small and fixed (opentelemetry/proto/trace/v1): here
each value is written once, into one buffer.

The bytes are those of `encode_spans(spans).SerializePartialToString()`, field for field in
the same order (tests/test_otlp_spans.py compares them on real spans). A value this writer
does not know (an attribute of another type, an int beyond 64 bits) raises `Unsupported`,
as text UTF-8 cannot hold raises UnicodeEncodeError (a lone surrogate), and the caller
encodes the batch with the exporters' encoder instead, which drops that value alone.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

#: OTLP's span kinds (trace.proto `Span.SpanKind`).
_KINDS = {
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
#: `Span.flags`: SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK, and IS_REMOTE when the parent is.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
_INT64 = 1 << 63
_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack
_double = struct.Struct("<d").pack
#: Attribute keys seen, as their KeyValue's first field (tag, length, UTF-8). Bound: keys
#: are the gateway's own names and the resource's; past KEYS_MAX it starts again empty.
_keys: dict[str, bytes] = {}
KEYS_MAX = 1024


class Unsupported(ValueError):
    """A value this writer does not encode: encode the batch the exporters' way."""


#: The varint of each number below 128: one byte (most lengths here).
_SMALL = tuple(bytes((i,)) for i in range(128))


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field: its `tag` (field number << 3 | 2), length and `body`."""
    n = len(body)
    return tag + (_SMALL[n] if n < 0x80 else _varint(n)) + body


def _value(v: Any) -> bytes:
    """An AnyValue's body (its oneof is written even when zero or empty)."""
    if isinstance(v, str):
        return _field(b"\x0a", v.encode("utf-8"))
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        if not -_INT64 <= v < _INT64:
            raise Unsupported(f"an int beyond 64 bits: {v}")
        return b"\x18" + _varint(v & 0xFFFFFFFFFFFFFFFF)
    if isinstance(v, float):
        return b"\x21" + _double(v)
    if isinstance(v, bytes):
        return _field(b"\x3a", v)
    if v is None:
        return b""
    if isinstance(v, Sequence):
        return _field(b"\x2a", b"".join([_field(b"\x0a", _value(x)) for x in v]))
    if isinstance(v, Mapping):
        kvs = [_field(b"\x0a", _key_value(str(k), x)) for k, x in v.items()]
        return _field(b"\x32", b"".join(kvs))
    raise Unsupported(f"an attribute of type {type(v).__name__}")


def _key(key: str) -> bytes:
    """A KeyValue's first field, kept by key (bounded: KEYS_MAX)."""
    prefix = _keys.get(key)
    if prefix is None:
        if len(_keys) >= KEYS_MAX:
            _keys.clear()
        prefix = _keys[key] = _field(b"\x0a", key.encode("utf-8")) if key else b""
    return prefix


def _key_value(key: str, v: Any) -> bytes:
    return _key(key) + _field(b"\x12", _value(v))


def _items(attributes: Any) -> Any:
    """An attribute mapping's items. A span's are a read-only view of a BoundedAttributes,
    whose items go through collections.abc's Python methods: its own dict's are read when
    it has one (the same items, in the same order)."""
    inner = getattr(attributes, "_dict", None)
    return inner.items() if type(inner) is dict else attributes.items()


def _attributes(tag: bytes, attributes: Any) -> bytes:
    """Each attribute as a KeyValue field numbered by `tag`."""
    if not attributes:
        return b""
    out = []
    keys, small = _keys, _SMALL
    for k, v in _items(attributes):
        # (`_field` written out: ~0.3 us an attribute fewer, ~15 attributes a span)
        if type(v) is str:  # (most: written here, no call)
            body = v.encode("utf-8")
            n = len(body)
            value = b"\x0a" + (small[n] if n < 0x80 else _varint(n)) + body
        else:
            value = _value(v)
        n = len(value)
        kv = (keys.get(k) or _key(k)) + b"\x12" + (small[n] if n < 0x80 else _varint(n)) + value
        n = len(kv)
        out.append(tag + (small[n] if n < 0x80 else _varint(n)) + kv)
    return b"".join(out)


def _count(tag: bytes, n: int) -> bytes:
    return tag + _varint(n) if n else b""


def _span(span: ReadableSpan) -> bytes:
    ctx = span.get_span_context()
    assert ctx is not None
    out = [b"\x0a\x10" + ctx.trace_id.to_bytes(16), b"\x12\x08" + ctx.span_id.to_bytes(8)]
    if ctx.trace_state:
        state = ",".join(f"{k}={v}" for k, v in ctx.trace_state.items())
        out.append(_field(b"\x1a", state.encode("utf-8")))
    parent = span.parent
    if parent is not None:
        out.append(b"\x22\x08" + parent.span_id.to_bytes(8))
    if span.name:
        out.append(_field(b"\x2a", span.name.encode("utf-8")))
    out.append(b"\x30" + _SMALL[_KINDS[span.kind]])
    if span.start_time:
        out.append(b"\x39" + _fixed64(span.start_time))
    if span.end_time:
        out.append(b"\x41" + _fixed64(span.end_time))
    # (`_attributes`, not the `attributes` property: that wraps it in a new read-only view)
    attributes = getattr(span, "_attributes", None)
    out.append(_attributes(b"\x4a", attributes if attributes is not None else span.attributes))
    out.append(_count(b"\x50", span.dropped_attributes))
    for event in span.events:
        body = b"\x09" + _fixed64(event.timestamp) if event.timestamp else b""
        body += _field(b"\x12", event.name.encode("utf-8")) if event.name else b""
        body += _attributes(b"\x1a", event.attributes)
        body += _count(b"\x20", event.dropped_attributes)
        out.append(_field(b"\x5a", body))
    out.append(_count(b"\x60", span.dropped_events))
    if span.links:
        raise Unsupported("links")  # (the gateway makes none)
    out.append(_count(b"\x70", span.dropped_links))
    status = span.status
    body = b""
    if status.description:
        body += _field(b"\x12", status.description.encode("utf-8"))
    if status.status_code.value:
        body += b"\x18" + _varint(status.status_code.value)
    out.append(_field(b"\x7a", body))
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)
    out.append(b"\x85\x01" + _fixed32(flags))
    return b"".join(out)


def encode(spans: Sequence[ReadableSpan]) -> bytes:
    """The request's bytes: the spans grouped by resource, then by instrumentation scope, in
    the order each first appears, as the exporters' encoder groups them (by equality; a
    Resource's hash is a JSON dump of its attributes, so the object a span shares with the
    one before it is taken without hashing)."""
    groups: dict[Any, dict[Any, list[bytes]]] = {}
    last_resource: Any = None
    last_scope: Any = None
    encoded: list[bytes] = []
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope or None
        if resource is not last_resource or scope is not last_scope or not encoded:
            encoded = groups.setdefault(resource, {}).setdefault(scope, [])
            last_resource, last_scope = resource, scope
        encoded.append(_span(span))
    out = []
    for resource, by_scope in groups.items():
        body = [_field(b"\x0a", _attributes(b"\x0a", resource.attributes))]
        for scope, spans_of in by_scope.items():
            scope_body = b""
            if scope is not None:
                scope_body = _field(b"\x0a", scope.name.encode("utf-8")) if scope.name else b""
                if scope.version:
                    scope_body += _field(b"\x12", scope.version.encode("utf-8"))
                scope_body += _attributes(b"\x1a", scope.attributes)
            parts = [_field(b"\x0a", scope_body), *(_field(b"\x12", s) for s in spans_of)]
            if scope is not None and scope.schema_url:
                parts.append(_field(b"\x1a", scope.schema_url.encode("utf-8")))
            body.append(_field(b"\x12", b"".join(parts)))
        if resource.schema_url:
            body.append(_field(b"\x1a", resource.schema_url.encode("utf-8")))
        out.append(_field(b"\x0a", b"".join(body)))
    return b"".join(out)


class Serialized:
    """Bytes that answer as the exporters' message does when asked for its bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializePartialToString(self) -> bytes:  # (protobuf's name)
        return self.data

    SerializeToString = SerializePartialToString


def request(spans: Sequence[ReadableSpan]) -> Any:
    """The OTLP/HTTP exporter's `encode_spans`, as `otel.py` hands it over: these bytes, or
    the exporters' own message for a batch holding what `encode` does not write."""
    try:
        return Serialized(encode(spans))
    except (Unsupported, UnicodeEncodeError):  # (a lone surrogate: theirs drops the value)
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        return encode_spans(spans)


def message(spans: Sequence[ReadableSpan]) -> Any:
    """The OTLP/gRPC exporter's request message: `request`'s bytes parsed by protobuf's C
    parser (a small part of what building it field by field costs), or its message."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    out = request(spans)
    return ExportTraceServiceRequest.FromString(out.data) if isinstance(out, Serialized) else out
