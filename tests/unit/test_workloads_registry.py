"""Every workload generator: seeded, ordered, registered, and reachable from replay and the simulator."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvroute.bench.replay_sources import CHAT_ENDPOINT, WORKLOADS, WorkloadChoice, workload_items
from simulator.requests import replay_requests
from workloads import GENERATORS, WorkloadRequest, generate_named, parse_options, workload_config

# Small enough that every generator runs in well under a second on this machine.
SMALL = {
    "repository-assistant": {"repositories": 3, "requests": 12, "prefix_min_tokens": 100, "prefix_max_tokens": 200},
    "support-chat": {"conversations": 4, "system_tokens": 60, "reply_max_tokens": 60},
    "rag": {"tenants": 3, "requests": 12, "instruction_min_tokens": 40, "instruction_max_tokens": 80,
            "corpus_passages": 20, "passages_per_request": 3, "passage_min_tokens": 20, "passage_max_tokens": 40},
    "batch": {"requests": 6, "document_min_tokens": 60, "document_max_tokens": 120},
    "generated-shared-prefix": {"groups": 4, "prompts_per_group": 3, "system_prompt_tokens": 128,
                                "question_tokens": 16, "output_tokens": 8},
    "prefix-repetition": {"num_prefixes": 3, "prefix_tokens": 64, "suffix_tokens": 32, "repetitions_per_prefix": 4,
                          "output_tokens": 8},
    "no-sharing": {"requests": 12, "prompt_min_tokens": 40, "prompt_max_tokens": 120},
}
NAMES = list(GENERATORS)


def small(name: str, **more) -> list[WorkloadRequest]:
    return generate_named(name, {**SMALL[name], **more})


def test_every_generator_is_registered_and_has_a_small_config():
    assert set(SMALL) == set(GENERATORS) == set(WORKLOADS)
    assert {"support-chat", "rag", "batch", "generated-shared-prefix", "prefix-repetition", "no-sharing"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_workload(name):
    assert small(name, seed=3) == small(name, seed=3)


@pytest.mark.parametrize("name", NAMES)
def test_different_seeds_differ(name):
    one, other = small(name, seed=3), small(name, seed=4)
    assert [r.messages for r in one] != [r.messages for r in other]


@pytest.mark.parametrize("name", NAMES)
def test_arrivals_non_decreasing_and_indices_in_order(name):
    workload = small(name)
    assert workload and [r.index for r in workload] == list(range(len(workload)))
    arrivals = [r.arrival_seconds for r in workload]
    assert all(a >= 0 and math.isfinite(a) for a in arrivals)
    assert arrivals == sorted(arrivals)


@pytest.mark.parametrize("name", NAMES)
def test_requests_are_chat_requests_with_an_output_length(name):
    for request in small(name):
        assert request.max_tokens >= 1
        assert [m["role"] for m in request.messages][0] == "system"
        assert request.messages[-1]["role"] == "user"
        assert all(m["content"] for m in request.messages)


@pytest.mark.parametrize("name", NAMES)
def test_replay_and_simulator_take_every_workload(name):
    choice = WorkloadChoice(requests=5, seed=1, options=tuple(f"{k}={v}" for k, v in SMALL[name].items()))
    items = workload_items(name, choice)
    assert len(items) == 5
    assert all(item.endpoint == CHAT_ENDPOINT and item.payload()["messages"] for item in items)
    simulated = replay_requests(WORKLOADS[name](choice))
    assert [r.index for r in simulated] == [item.index for item in items]
    assert all(r.prompt_tokens > 0 for r in simulated)


def test_requests_and_rate_set_fields_or_truncate():
    assert len(generate_named("rag", SMALL["rag"], requests=7)) == 7  # a field
    chat = generate_named("support-chat", SMALL["support-chat"])
    assert generate_named("support-chat", SMALL["support-chat"], requests=5) == chat[:5]  # no field: the first N
    assert len(generate_named("support-chat", SMALL["support-chat"], requests=10_000)) == len(chat)
    fast = generate_named("no-sharing", SMALL["no-sharing"], rate=100.0)
    assert fast[-1].arrival_seconds < small("no-sharing")[-1].arrival_seconds
    assert generate_named("batch", SMALL["batch"], rate=5.0) == small("batch")  # batch has no rate: ignored


def test_options_are_parsed_as_the_field_types():
    config = workload_config("generated-shared-prefix", parse_options(["groups=8", "rate=inf", "prompts-per-group=2"]))
    assert (config.groups, config.prompts_per_group, config.rate) == (8, 2, math.inf)
    assert dataclasses.replace(config, groups=64).system_prompt_tokens == 2048  # defaults kept


@pytest.mark.parametrize("options,message", [(["groups"], "KEY=VALUE"), (["groupz=2"], "no option groupz"),
                                             (["groups=two"], "an integer")])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        workload_config("generated-shared-prefix", parse_options(options))


def test_unknown_workload():
    with pytest.raises(ValueError, match="unknown workload"):
        generate_named("nope")
