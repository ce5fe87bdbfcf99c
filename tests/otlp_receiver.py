"""A real OTLP receiver on loopback for the tracing tests (and the relay_cost benchmark's sink):
OTLP/HTTP (`POST /v1/traces`, `POST /v1/metrics`, protobuf bodies) and OTLP/gRPC (the
collector's TraceService and MetricsService), both decoding the official `opentelemetry-proto`
messages, each in threads of its own so that it answers whatever the test's event loop does.

Spans are kept flattened (`Span`): ids in hex, attribute values as Python values, events by
name; metrics by name with their data points' attributes.
"""

from __future__ import annotations

import gzip
import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

#: Span kinds of the protocol (opentelemetry.proto.trace.v1.Span.SpanKind).
KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return _attrs(v.kvlist_value.values)
    return getattr(v, which) if which else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str
    start: int  # ns since the epoch
    end: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status: int  # 0 unset, 1 ok, 2 error
    trace_state: str
    resource: dict[str, Any]
    event_times: list[tuple[str, int]]  # (name, ns since the epoch) of each event

    def event(self, name: str) -> dict[str, Any] | None:
        return next((attrs for n, attrs in self.events if n == name), None)


@dataclass
class Received:
    """Everything exported to this receiver, whichever protocol brought it."""

    spans: list[Span] = field(default_factory=list)
    #: metric name -> data points' attribute dicts (histograms: with their counts and sums).
    metrics: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    requests: int = 0  # export requests of any kind
    raw: list[bytes] = field(default_factory=list)  # every decoded body, for "no key in any"
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_traces(self, req: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            self.requests += 1
            self.raw.append(req.SerializeToString())
            for rs in req.resource_spans:
                resource = _attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            Span(
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                s.name,
                                KINDS.get(s.kind, str(s.kind)),
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                                _attrs(s.attributes),
                                [(e.name, _attrs(e.attributes)) for e in s.events],
                                s.status.code,
                                s.trace_state,
                                resource,
                                [(e.name, e.time_unix_nano) for e in s.events],
                            )
                        )

    def add_metrics(self, req: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        with self.lock:
            self.requests += 1
            self.raw.append(req.SerializeToString())
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        points = self.metrics.setdefault(m.name, [])
                        data = m.WhichOneof("data")
                        for p in getattr(m, data).data_points if data else ():
                            point = _attrs(p.attributes)
                            if data == "histogram":
                                point["_count"], point["_sum"] = p.count, p.sum
                            points.append(point)

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.snapshot() if s.trace_id == trace_id]


class _Handler(BaseHTTPRequestHandler):
    received: Received  # set on the subclass per server

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        try:
            if self.path == "/v1/traces":
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                self.received.add_traces(req)
                answer = trace_service_pb2.ExportTraceServiceResponse()
            elif self.path == "/v1/metrics":
                mreq = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
                self.received.add_metrics(mreq)
                answer = metrics_service_pb2.ExportMetricsServiceResponse()
            else:
                self.send_error(404)
                return
        except DecodeError:
            self.send_error(400)
            return
        out = answer.SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the tests read what was received, not the access log


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: Any, context: Any) -> Any:
        self.received.add_traces(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: Any, context: Any) -> Any:
        self.received.add_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class Receiver:
    """`with Receiver() as r:` an OTLP/HTTP endpoint at `r.http_url` and an OTLP/gRPC one at
    `r.grpc_url`, both on 127.0.0.1, both feeding `r.received`."""

    def __init__(self) -> None:
        self.received = Received()
        handler = type("Handler", (_Handler,), {"received": self.received})
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._http.daemon_threads = True
        self.http_url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _Traces(self.received), self._grpc
        )
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            _Metrics(self.received), self._grpc
        )
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        self.grpc_url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Receiver:
        self._thread.start()
        self._grpc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._grpc.stop(grace=None)

    def env(self, protocol: str = "http/protobuf", **extra: str) -> dict[str, str]:
        """The gateway's environment for exporting here (a batch every 50 ms)."""
        url = self.grpc_url if protocol == "grpc" else self.http_url
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_SERVICE_NAME": "tokenpipe-test",
            **extra,
        }
