"""foundation.tracing's real OTLP exporters, over HTTP and gRPC, to a receiver on loopback: a span
and its child made from the carrier arrive in one trace, with the process's service name, and
``shutdown`` exports them before it returns (what a stopping process relies on)."""

from __future__ import annotations

import pytest

from foundation import tracing
from tests.otlp_receiver import running_otlp_grpc_receiver, running_otlp_receiver


@pytest.mark.parametrize("protocol, receiver", [("http", running_otlp_receiver),
                                                ("grpc", running_otlp_grpc_receiver)])
def test_spans_reach_the_collector_in_one_trace_by_either_protocol(protocol, receiver, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # nothing leaves before shutdown flushes it
    with receiver() as collector:
        assert tracing.configure("kvroute-orchestrator", collector.url, protocol, {"service.instance.id": "o1"})
        try:
            api = tracing.start_span("chat m", kind=tracing.SERVER, attributes={tracing.GEN_AI_INPUT_TOKENS: 12})
            decode = tracing.start_span("kvroute.decode", tracing.remote_parent(tracing.carrier(api)),
                                        tracing.SERVER)
            tracing.end_span(decode)
            tracing.end_span(api)
            assert collector.spans() == []  # batched, not yet sent
        finally:
            tracing.shutdown()
        spans = {span.name: span for span in collector.spans()}
    assert set(spans) == {"chat m", "kvroute.decode"}
    assert spans["kvroute.decode"].trace_id == spans["chat m"].trace_id
    assert spans["kvroute.decode"].parent_span_id == spans["chat m"].span_id
    assert spans["chat m"].attributes == {"gen_ai.usage.input_tokens": 12}
    assert spans["chat m"].resource["service.name"] == "kvroute-orchestrator"
    assert spans["chat m"].resource["service.instance.id"] == "o1"
