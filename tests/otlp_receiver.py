"""Local OTLP receivers for tests, on a free loopback port: over HTTP (``POST /v1/traces``,
protobuf, plain or gzip) or gRPC (the ``TraceService/Export`` call). Each decodes every
``ExportTraceServiceRequest`` with opentelemetry-proto and keeps every span it was sent, with
its process's resource attributes: what a real collector (Jaeger, Tempo, the OpenTelemetry
Collector) would receive from kvroute."""

from __future__ import annotations

import gzip
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import (
    TraceServiceServicer,
    add_TraceServiceServicer_to_server,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the exporting process's service.name
    resource: dict
    name: str
    kind: str  # "SERVER", "CLIENT", "INTERNAL", ...
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict
    status_code: int  # 0 unset, 1 ok, 2 error
    start_ns: int
    end_ns: int


def _value(any_value):
    field = any_value.WhichOneof("value")
    if field == "array_value":
        return tuple(_value(item) for item in any_value.array_value.values)
    return getattr(any_value, field) if field else None


def _attributes(key_values) -> dict:
    return {pair.key: _value(pair.value) for pair in key_values}


def decode_spans(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    resource.get("service.name", ""), resource, span.name,
                    SpanProto.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"), span.trace_id.hex(),
                    span.span_id.hex(), span.parent_span_id.hex(), _attributes(span.attributes), span.status.code,
                    span.start_time_unix_nano, span.end_time_unix_nano))
    return spans


class OtlpReceiver:
    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"  # a bare collector address, as users give it
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.requests = 0

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)
            self.requests += 1

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, condition: Callable[[list[ReceivedSpan]], bool], timeout: float) -> list[ReceivedSpan]:
        """The spans received once ``condition`` holds for them; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not condition(spans := self.spans()):
            assert time.monotonic() < deadline, f"condition not met in {timeout} s; got {[s.name for s in spans]}"
            time.sleep(0.1)
        return spans


def trace_of(spans: list[ReceivedSpan], response_id: str) -> dict[tuple[str, str], ReceivedSpan]:
    """The spans of the trace whose API span answered ``response_id``, by (service, span name)."""
    traces = defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    for trace in traces.values():
        if any(span.attributes.get("gen_ai.response.id") == response_id for span in trace):
            return {(span.service, span.name): span for span in trace}
    return {}


def _handler(receiver: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != TRACES_PATH:
                return self._reply(404, b"")
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            receiver.add(decode_spans(ExportTraceServiceRequest.FromString(body)))
            self._reply(200, ExportTraceServiceResponse().SerializeToString())

        def _reply(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format, *args):  # the test's output stays readable
            pass

    return Handler


@contextmanager
def running_otlp_receiver() -> Iterator[OtlpReceiver]:
    """The OTLP/HTTP receiver, serving until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), None)
    receiver = OtlpReceiver(server.server_address[1])
    server.RequestHandlerClass = _handler(receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


class _TraceService(TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver):
        self.receiver = receiver

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        self.receiver.add(decode_spans(request))
        return ExportTraceServiceResponse()


@contextmanager
def running_otlp_grpc_receiver() -> Iterator[OtlpReceiver]:
    """The OTLP/gRPC receiver (plaintext, as an ``http://`` endpoint asks), serving until the block ends."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    receiver = OtlpReceiver(port)
    add_TraceServiceServicer_to_server(_TraceService(receiver), server)
    server.start()
    try:
        yield receiver
    finally:
        server.stop(grace=None)
