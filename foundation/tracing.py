"""OpenTelemetry traces, behind one small module so the rest of kvroute never calls OTel itself.

Off until ``configure`` is given an OTLP endpoint. While off, ``start_span`` hands back one
shared non-recording span and ``carrier`` gives None, so a request costs a flag check, not
a span: nothing is allocated, timed or exported.

Spans are parented explicitly (``parent=``), never through OTel's "current span": a request's
spans live in async generators that different tasks iterate and close, where a context
attached in one task cannot be detached in another. Across processes a span travels as a
W3C ``traceparent`` carrier (``carrier`` → a dict on the wire → ``remote_parent``).

Only the API is imported here (a core dependency); the SDK and the OTLP exporters (the
``tracing`` extra) are imported by ``configure`` when tracing is turned on.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger("kvroute.tracing")

Span = trace.Span
NO_SPAN = trace.INVALID_SPAN  # what every span is while tracing is off
SERVER, CLIENT, INTERNAL = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL
PROTOCOLS = ("http", "grpc")  # OTLP over HTTP (protobuf) or gRPC
EXPORT_TIMEOUT_SECONDS = 5.0  # one export; a collector that is down must not hold a process's exit long
HTTP_TRACES_PATH = "/v1/traces"

# Attribute names of OpenTelemetry's GenAI semantic conventions, where one fits.
GEN_AI_OPERATION = "gen_ai.operation.name"  # "chat", "text_completion"
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # prompt tokens not computed: a cache held them

_propagator = TraceContextTextMapPropagator()
_provider = None  # the SDK's TracerProvider while tracing is on
_tracer: trace.Tracer | None = None
_NOT_RECORDING = contextlib.nullcontext(NO_SPAN)  # reusable: the whole cost of ``span`` while off


class TracingUnavailable(ValueError):
    """Tracing was asked for, but the SDK or an exporter is not installed: a settings error,
    which the command line reports in one line (``kvroute.cli.main``)."""


def check(endpoint: str, protocol: str) -> None:
    """ValueError unless ``protocol`` is one of ``PROTOCOLS`` and ``endpoint`` is empty (off) or an http(s) URL."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"otlp_protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if endpoint and (urlparse(endpoint).scheme not in ("http", "https") or not urlparse(endpoint).netloc):
        raise ValueError(f"otlp_endpoint must be an http:// or https:// URL, e.g. http://127.0.0.1:4318, "
                         f"got {endpoint!r}")


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP URL spans are posted to: a bare collector address gets ``/v1/traces``."""
    return endpoint.rstrip("/") + HTTP_TRACES_PATH if urlparse(endpoint).path in ("", "/") else endpoint


def configure(service_name: str, endpoint: str, protocol: str = "http",
              attributes: Mapping[str, str] | None = None) -> bool:
    """Export this process's spans to the OTLP collector at ``endpoint``; an empty endpoint
    leaves tracing off. Returns whether tracing is on. Call once at start; ``shutdown`` at exit."""
    check(endpoint, protocol)
    if not endpoint:
        return False
    install(_exporter(endpoint, protocol), service_name, attributes)
    logger.info("tracing on: %s spans to %s (OTLP over %s)", service_name, endpoint, protocol)
    return True


def install(exporter, service_name: str, attributes: Mapping[str, str] | None = None, batch: bool = True) -> None:
    """Turn tracing on with any SDK ``SpanExporter``. ``batch``: export from a background
    thread in batches (its delay is ``OTEL_BSP_SCHEDULE_DELAY``, 5 s unless set); else each
    span as it ends, on the caller's thread (tests)."""
    global _provider, _tracer
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as error:
        raise TracingUnavailable(f"tracing needs the OpenTelemetry SDK: pip install 'kvroute[tracing]' ({error})") \
            from error
    shutdown()
    resource = Resource.create({"service.name": service_name, **(attributes or {})})
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # ``shutdown`` flushes, not atexit
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("kvroute")


def _exporter(endpoint: str, protocol: str):
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            return GrpcExporter(endpoint=endpoint, insecure=urlparse(endpoint).scheme == "http",
                                timeout=EXPORT_TIMEOUT_SECONDS)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=traces_url(endpoint), timeout=EXPORT_TIMEOUT_SECONDS)
    except ImportError as error:
        raise TracingUnavailable(f"OTLP over {protocol} needs its exporter: pip install 'kvroute[tracing]' "
                                 f"({error})") from error


def enabled() -> bool:
    return _tracer is not None


def shutdown(timeout_seconds: float = EXPORT_TIMEOUT_SECONDS) -> None:
    """Export the spans still queued (waiting at most ``timeout_seconds``), then turn tracing off."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.force_flush(int(timeout_seconds * 1000))
        provider.shutdown()


def start_span(name: str, parent: Span | Context | None = None, kind: SpanKind = INTERNAL,
               attributes: Mapping[str, Any] | None = None, start_time: float | None = None) -> Span:
    """A started span (the caller ends it, see ``end_span``); ``NO_SPAN`` while tracing is off.
    ``parent``: a span of this process, or a ``remote_parent`` context; None starts a trace.
    ``start_time``: seconds since the epoch (``time.time()``), when it began before now."""
    if _tracer is None:
        return NO_SPAN
    context = trace.set_span_in_context(parent, Context()) if isinstance(parent, Span) else parent or Context()
    return _tracer.start_span(name, context, kind, _present(attributes), start_time=_nanoseconds(start_time))


def end_span(span: Span, error: BaseException | str | None = None, end_time: float | None = None) -> None:
    """End ``span``, marked failed when ``error`` is given (its type or code becomes ``error.type``)."""
    if not span.is_recording():
        return
    if error is not None:
        kind = error if isinstance(error, str) else getattr(error, "code", None) or type(error).__name__
        span.set_attribute("error.type", str(kind))
        span.set_status(Status(StatusCode.ERROR, None if isinstance(error, str) else str(error)[:200]))
    span.end(_nanoseconds(end_time))


def _nanoseconds(seconds: float | None) -> int | None:
    """Epoch seconds as OTel's integer nanoseconds, the fraction apart (a float holds ~0.2 µs at 1e18)."""
    if seconds is None:
        return None
    whole = int(seconds)
    return whole * 1_000_000_000 + round((seconds - whole) * 1e9)


@contextlib.contextmanager
def _recorded_span(name: str, parent, kind: SpanKind, attributes) -> Iterator[Span]:
    span = start_span(name, parent, kind, attributes)
    try:
        yield span
    except BaseException as error:
        end_span(span, error)
        raise
    end_span(span)


def span(name: str, parent: Span | Context | None = None, kind: SpanKind = INTERNAL,
         attributes: Mapping[str, Any] | None = None):
    """``start_span`` for one block of code: ended when the block ends, failed if it raises."""
    if _tracer is None:
        return _NOT_RECORDING
    return _recorded_span(name, parent, kind, attributes)


def set_attributes(span: Span, attributes: Mapping[str, Any]) -> None:
    """Set every attribute whose value is not None (OTel refuses None, with a warning each)."""
    if span.is_recording():
        span.set_attributes(_present(attributes))


def _present(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {key: value for key, value in (attributes or {}).items() if value is not None}


def carrier(span: Span) -> dict[str, str] | None:
    """``span`` as W3C trace-context headers (``traceparent``, and ``tracestate`` if any), to send
    to another process; None for ``NO_SPAN``, so an untraced request carries nothing. A span the
    sampler dropped still travels (unsampled), so the other process drops its spans too."""
    if not span.get_span_context().is_valid:
        return None
    headers: dict[str, str] = {}
    _propagator.inject(headers, trace.set_span_in_context(span, Context()))
    return headers


def remote_parent(headers: Mapping[str, str] | None) -> Context | None:
    """The parent a ``carrier`` (or a client's ``traceparent`` header) names; None when it names none
    or is malformed, so the span it parents starts a trace of its own."""
    if not headers or _tracer is None:
        return None
    context = _propagator.extract({key: headers[key] for key in ("traceparent", "tracestate") if key in headers})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def add_tracing_arguments(parser: argparse.ArgumentParser) -> None:
    """The tracing flags of a worker process (the orchestrator's come from its settings)."""
    parser.add_argument("--otlp-endpoint", default=os.environ.get("KVROUTE_OTLP_ENDPOINT", ""),
                        help="OpenTelemetry collector to send traces to, e.g. http://127.0.0.1:4318 "
                             "(http) or http://127.0.0.1:4317 (grpc); empty: no tracing "
                             "(env KVROUTE_OTLP_ENDPOINT)")
    parser.add_argument("--otlp-protocol", choices=PROTOCOLS, default=os.environ.get("KVROUTE_OTLP_PROTOCOL", "http"),
                        help="OTLP over http (protobuf) or grpc (default: %(default)s; env KVROUTE_OTLP_PROTOCOL)")
