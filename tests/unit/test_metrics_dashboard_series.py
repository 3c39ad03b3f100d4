"""The series the Grafana dashboard and the alert rules read (deploy/grafana, deploy/prometheus):
prompt tokens per prefilling worker, actual TTFT over the plan's estimate, the workers'
queues from their heartbeats, and rare-event counters that exist at 0 before their first
event (so that the first one shows in rate() and increase())."""

from __future__ import annotations

from prometheus_client import generate_latest

from foundation import wire
from orchestrator.decisions import DecisionRecord
from orchestrator.disagg import HandoffRecord
from orchestrator.index import PrefixIndex
from orchestrator.metrics import Metrics
from orchestrator.planner.views import Decision, Estimate, Plan, PlanKind
from orchestrator.service import Job
from tests.unit.test_metrics_departed import RegisteredFleet, exported


def sample(metrics: Metrics, line_start: str) -> float:
    lines = [line for line in generate_latest(metrics.registry).decode().splitlines() if line.startswith(line_start)]
    assert len(lines) == 1, lines
    return float(lines[0].split()[-1])


def completed(metrics: Metrics, estimated_ttft: float, actual_ttft: float) -> None:
    estimate = Estimate(queue_wait=0.0, prefill=estimated_ttft, transfer=0.0, ttft=estimated_ttft, gap=0.01,
                        reused_tokens=0, transfer_bytes=0)
    plan = Plan(PlanKind.DISAGG, "decode-b", "prefill-a", estimate)
    job = Job(prompt_token_ids=list(range(300)), sampling=wire.SamplingSpec(max_tokens=4), cache_salt="s")
    record = DecisionRecord.from_decision(Decision("cache_aware", plan, [plan], "cheapest"), "r", 0, job.request_id,
                                          300, 16, 0)
    record.actual.ttft = actual_ttft
    handoff = HandoffRecord(job.request_id, first_token_at=job.arrived_at + actual_ttft)
    metrics.observe_request(job, plan, handoff, record)


def test_prompt_tokens_are_counted_per_prefilling_worker_and_ttft_against_its_estimate():
    metrics = Metrics()
    completed(metrics, estimated_ttft=0.2, actual_ttft=0.3)  # 1.5x the estimate
    completed(metrics, estimated_ttft=0.2, actual_ttft=0.19)  # 0.95x
    assert sample(metrics, 'kvroute_prompt_tokens_total{worker="prefill-a"}') == 600
    assert sample(metrics, 'kvroute_ttft_estimate_ratio_count{policy="cache_aware"}') == 2
    assert sample(metrics, 'kvroute_ttft_estimate_ratio_bucket{le="0.9",policy="cache_aware"}') == 0
    assert sample(metrics, 'kvroute_ttft_estimate_ratio_bucket{le="1.1",policy="cache_aware"}') == 1
    assert sample(metrics, 'kvroute_ttft_estimate_ratio_bucket{le="1.5",policy="cache_aware"}') == 2


def test_a_scrape_exports_each_workers_queue_and_zeroed_rare_counters():
    fleet, metrics = RegisteredFleet(), Metrics()
    beat = wire.Heartbeat(worker_id="decode-b", role="decode", incarnation="i", rpc_address="tcp://decode-b:1",
                          load=wire.WorkerLoad(num_waiting=3, num_queued_prefill_tokens=900), sent_at=0.0,
                          model_fingerprint="m")
    assert fleet.registry.observe(beat, now=0.0).accepted
    metrics.refresh_fleet(fleet, PrefixIndex())
    assert sample(metrics, 'kvroute_worker_requests_waiting{worker="decode-b"}') == 3
    assert sample(metrics, 'kvroute_worker_queued_prefill_tokens{worker="decode-b"}') == 900
    assert sample(metrics, 'kvroute_index_mispredictions_total{worker="decode-b"}') == 0
    assert sample(metrics, 'kvroute_claim_misses_total{worker="decode-b"}') == 0

    fleet.registry.remove("decode-b")
    metrics.refresh_fleet(fleet, PrefixIndex())
    assert "decode-b" not in exported(metrics)
