"""Worker settings that shape the engine: per-role defaults and what reaches vLLM."""

from __future__ import annotations

from dataclasses import replace

import pytest

from worker.cli_args import add_worker_arguments, settings_from_args
from worker.engine import engine_args
from worker.settings import (
    DECODE_LONG_PREFILL_TOKENS,
    PREFILL_LONG_PREFILL_TOKENS,
    UNIFIED_LONG_PREFILL_TOKENS,
    WorkerSettings,
)

LOCAL_EVENTS = "ipc:///tmp/kvroute-events-test/events"  # what a worker sets at start (worker.event_relay)


@pytest.mark.parametrize("role, explicit, expected", [
    ("decode", None, DECODE_LONG_PREFILL_TOKENS),  # a local prefill must not hold pulls and streams
    ("prefill", None, PREFILL_LONG_PREFILL_TOKENS),  # a hit must not share one step with a whole cold prompt
    ("unified", None, UNIFIED_LONG_PREFILL_TOKENS),  # serving alone, as one plain vLLM server: no cap
    ("unified", 256, 256),
    ("decode", 0, 0),
    ("prefill", 512, 512),
])
def test_long_prefill_cap_by_role_reaches_the_engine(role, explicit, expected):
    settings = WorkerSettings(role=role, model="/models/m", long_prefill_tokens=explicit,
                              kv_events_local_address=LOCAL_EVENTS)
    assert settings.long_prefill_step_tokens == expected
    assert engine_args(settings).long_prefill_token_threshold == expected


def test_negative_long_prefill_cap_is_refused():
    with pytest.raises(ValueError, match="long_prefill_tokens"):
        WorkerSettings(role="decode", model="/models/m", long_prefill_tokens=-1)


@pytest.fixture
def parser(monkeypatch):
    """The worker's flag parser, with the model and dtype resolution that need a machine stubbed."""
    import argparse

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    monkeypatch.setattr("foundation.model_prep.resolve_model", lambda model: "/models/m")
    monkeypatch.setattr("worker.dtype.resolve_here", lambda dtype: "float32")
    return parser


def settings_of(parser, role: str, *flags: str) -> WorkerSettings:
    settings = settings_from_args(parser.parse_args(["--model", "/models/m", *flags]), role)
    return replace(settings, kv_events_local_address=LOCAL_EVENTS)


def test_long_prefill_flag(parser):
    assert settings_of(parser, "decode", "--long-prefill-tokens", "128").long_prefill_tokens == 128
    assert settings_of(parser, "decode").long_prefill_tokens is None


def test_transfer_link_flag_reaches_the_connector(parser):
    from worker.engine import kv_transfer_config

    settings = settings_of(parser, "decode", "--transfer-link", "gloo")
    assert settings.transfer_link == "gloo"
    assert kv_transfer_config(settings.with_ports()).kv_connector_extra_config["transfer_link"] == "gloo"
    assert settings_of(parser, "decode").transfer_link == "endpoint"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "/models/m", "--transfer-link", "carrier-pigeon"])


def test_step_tokens_flag_reaches_the_engine(parser):
    assert engine_args(settings_of(parser, "prefill", "--step-tokens", "512")).max_num_batched_tokens == 512
    assert engine_args(settings_of(parser, "prefill")).max_num_batched_tokens is None  # the engine's own default
    with pytest.raises(ValueError, match="step_tokens"):
        WorkerSettings(role="prefill", model="/models/m", step_tokens=0)


def test_probe_tokens_flag(parser):
    assert settings_of(parser, "prefill").probe_tokens == 128
    assert settings_of(parser, "decode", "--probe-tokens", "0").probe_tokens == 0  # no probe
    for bad in (-1, 4096):
        with pytest.raises(ValueError, match="probe_tokens"):
            WorkerSettings(role="prefill", model="/models/m", max_model_len=4096, probe_tokens=bad)


@pytest.mark.parametrize("requested, cuda, expected", [
    (None, False, 32),  # CPU: finer blocks, so a hit recomputes less of the shared prefix's tail
    (None, True, None),  # GPU: vLLM's own default
    (128, False, 128),
    (16, True, 16),
])
def test_block_size_default_depends_on_the_platform(requested, cuda, expected):
    from worker.block_size import resolve_block_size

    assert resolve_block_size(requested, cuda) == expected


def test_explicit_block_size_reaches_the_engine(parser):
    assert engine_args(settings_of(parser, "prefill", "--block-size", "64")).block_size == 64


def test_tracing_flags_reach_the_settings_and_bad_ones_are_refused(parser):
    traced = settings_of(parser, "decode", "--otlp-endpoint", "http://collector:4318", "--otlp-protocol", "http")
    assert (traced.otlp_endpoint, traced.otlp_protocol) == ("http://collector:4318", "http")
    assert settings_of(parser, "decode").otlp_endpoint == ""  # off by default
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "/models/m", "--otlp-protocol", "thrift"])
    with pytest.raises(ValueError, match="otlp_endpoint"):
        WorkerSettings(role="decode", model="/models/m", otlp_endpoint="collector:4318")


def test_scheduling_flag_reaches_the_engine(parser):
    assert engine_args(settings_of(parser, "unified", "--scheduling", "shortest-first")).scheduling_policy == "priority"
    assert engine_args(settings_of(parser, "unified", "--scheduling", "fcfs")).scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "/models/m", "--scheduling", "lifo"])
    with pytest.raises(ValueError, match="scheduling"):
        WorkerSettings(role="unified", model="/models/m", scheduling="lifo")
