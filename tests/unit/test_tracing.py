"""foundation.tracing: W3C trace context in and out of a dict, explicit parents, failed spans,
settings checks, and the path taken while tracing is off (nothing recorded, nothing made)."""

from __future__ import annotations

import sys

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from foundation import tracing

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"


@pytest.fixture
def exported():
    """Tracing on, each span exported as it ends into memory; off again afterwards."""
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "kvroute-test", {"service.instance.id": "w0"}, batch=False)
    yield exporter
    tracing.shutdown()


@pytest.fixture
def off():
    tracing.shutdown()
    yield
    tracing.shutdown()


def test_a_carrier_makes_the_remote_span_a_child_in_the_same_trace(exported):
    parent = tracing.start_span("orchestrator", kind=tracing.SERVER)
    headers = tracing.carrier(parent)
    assert list(headers) == ["traceparent"]
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    assert int(trace_id, 16) == parent.get_span_context().trace_id
    assert int(span_id, 16) == parent.get_span_context().span_id

    child = tracing.start_span("worker", tracing.remote_parent(headers), tracing.SERVER)
    tracing.end_span(child)
    tracing.end_span(parent)
    worker, orchestrator = exported.get_finished_spans()
    assert worker.context.trace_id == orchestrator.context.trace_id
    assert worker.parent.span_id == orchestrator.context.span_id
    assert worker.parent.is_remote and worker.kind is SpanKind.SERVER
    assert worker.resource.attributes["service.name"] == "kvroute-test"
    assert worker.resource.attributes["service.instance.id"] == "w0"


def test_a_clients_traceparent_and_tracestate_are_followed(exported):
    headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01", "tracestate": "vendor=x",
               "authorization": "Bearer sk-never-read"}
    span = tracing.start_span("api", tracing.remote_parent(headers))
    assert tracing.carrier(span)["tracestate"] == "vendor=x"
    tracing.end_span(span)
    (finished,) = exported.get_finished_spans()
    assert f"{finished.context.trace_id:032x}" == TRACE_ID
    assert f"{finished.parent.span_id:016x}" == CLIENT_SPAN_ID


@pytest.mark.parametrize("headers", [None, {}, {"traceparent": "garbage"},
                                     {"traceparent": f"00-{'0' * 32}-{CLIENT_SPAN_ID}-01"}])
def test_no_or_a_malformed_context_starts_a_trace_of_its_own(exported, headers):
    assert tracing.remote_parent(headers) is None
    tracing.end_span(tracing.start_span("api", tracing.remote_parent(headers)))
    (finished,) = exported.get_finished_spans()
    assert finished.parent is None


def test_a_span_of_this_process_parents_explicitly_not_through_the_current_context(exported):
    parent = tracing.start_span("parent")
    with tracing.span("child", parent, attributes={"kept": 1, "dropped": None}) as child:
        tracing.set_attributes(child, {"also_dropped": None, "late": "yes"})
    orphan = tracing.start_span("orphan")  # no parent given: a new trace, whatever ran before
    tracing.end_span(orphan)
    tracing.end_span(parent)
    child, orphan, parent = exported.get_finished_spans()
    assert child.parent.span_id == parent.context.span_id
    assert dict(child.attributes) == {"kept": 1, "late": "yes"}
    assert orphan.parent is None and orphan.context.trace_id != parent.context.trace_id


def test_a_failing_block_marks_its_span_failed_with_the_error_code(exported):
    class CodedError(RuntimeError):
        code = "overloaded"

    with pytest.raises(CodedError), tracing.span("placement"):
        raise CodedError("every worker is at capacity")
    tracing.end_span(tracing.start_span("pull"), "pull_failed")
    placement, pull = exported.get_finished_spans()
    assert placement.status.status_code is StatusCode.ERROR
    assert placement.status.description == "every worker is at capacity"
    assert placement.attributes["error.type"] == "overloaded"
    assert pull.attributes["error.type"] == "pull_failed" and pull.status.status_code is StatusCode.ERROR


def test_explicit_times_in_epoch_seconds(exported):
    span = tracing.start_span("kv_pull", start_time=1_700_000_000.25)
    tracing.end_span(span, end_time=1_700_000_000.75)
    (finished,) = exported.get_finished_spans()
    assert (finished.start_time, finished.end_time) == (1_700_000_000_250_000_000, 1_700_000_000_750_000_000)


def test_off_nothing_is_recorded_nor_made(off):
    assert not tracing.enabled()
    span = tracing.start_span("api", tracing.remote_parent({"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"}))
    assert span is tracing.NO_SPAN and not span.is_recording()
    assert tracing.carrier(span) is None  # so an untraced request carries no context to its workers
    # One shared, reusable no-op: a request pays a flag check, not a generator or a span per block.
    assert tracing.span("placement") is tracing.span("decode")
    with tracing.span("placement") as block:
        assert block is tracing.NO_SPAN
    tracing.set_attributes(span, {"x": 1})
    tracing.end_span(span, "ignored")


def test_shutdown_exports_what_is_queued_and_turns_tracing_off():
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "kvroute-test")  # batched: exported by a background thread, later
    tracing.end_span(tracing.start_span("last"))
    tracing.shutdown()
    assert [s.name for s in exporter.get_finished_spans()] == ["last"]
    assert tracing.start_span("after") is tracing.NO_SPAN


def test_an_empty_endpoint_leaves_tracing_off(off):
    assert tracing.configure("kvroute-orchestrator", "") is False
    assert not tracing.enabled()


@pytest.mark.parametrize("endpoint, protocol", [("127.0.0.1:4318", "http"), ("ftp://collector:21", "http"),
                                                ("http://", "http"), ("http://collector:4318", "thrift")])
def test_bad_endpoints_and_protocols_are_refused_saying_why(endpoint, protocol):
    with pytest.raises(ValueError, match="otlp_"):
        tracing.check(endpoint, protocol)


@pytest.mark.parametrize("endpoint, url", [
    ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
    ("http://127.0.0.1:4318/", "http://127.0.0.1:4318/v1/traces"),
    ("https://tempo.example:443/otlp/v1/traces", "https://tempo.example:443/otlp/v1/traces"),
])
def test_a_bare_http_collector_address_gets_the_traces_path(endpoint, url):
    assert tracing.traces_url(endpoint) == url


def test_a_dropped_trace_stays_dropped_in_the_process_it_travels_to(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")  # keep none: the orchestrator's choice
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "kvroute-test", batch=False)
    try:
        api = tracing.start_span("api", kind=tracing.SERVER)
        assert not api.is_recording()
        headers = tracing.carrier(api)
        assert int(headers["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0  # not sampled, and said so
        worker = tracing.start_span("kvroute.decode", tracing.remote_parent(headers))
        assert not worker.is_recording()  # not a trace of its own either
        tracing.end_span(worker)
        tracing.end_span(api)
        assert exporter.get_finished_spans() == ()
    finally:
        tracing.shutdown()



@pytest.mark.parametrize("protocol, missing", [("http", "opentelemetry.sdk.trace"),
                                               ("grpc", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")])
def test_an_endpoint_without_the_tracing_extra_is_a_one_line_settings_error(monkeypatch, capsys, protocol, missing):
    from kvroute.cli import main

    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: importing it raises ImportError
    with pytest.raises(SystemExit) as exited:
        main(["orchestrator", "--otlp-endpoint", "http://127.0.0.1:4318", "--otlp-protocol", protocol])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and not tracing.enabled()
    assert "pip install 'kvroute[tracing]'" in error and "Traceback" not in error and len(error.splitlines()) == 1
