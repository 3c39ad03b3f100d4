"""The repository-assistant workload generator: pure, seeded, and shaped as documented."""

from __future__ import annotations

import statistics
from collections import Counter

import pytest

from tests.unit.workload_text import shares_substring
from workloads import (
    RepositoryAssistantConfig,
    WorkloadRequest,
    approx_tokens,
    generate_workload,
    prefix_target_tokens,
    repository_prefix,
    repository_prefixes,
    zipf_weights,
)

SMALL = RepositoryAssistantConfig(repositories=6, requests=60, rate=2.0, seed=7)


def test_same_seed_same_workload():
    assert generate_workload(SMALL) == generate_workload(RepositoryAssistantConfig(**vars(SMALL)))


def test_different_seeds_differ():
    one, other = generate_workload(SMALL), generate_workload(RepositoryAssistantConfig(**{**vars(SMALL), "seed": 8}))
    assert [r.arrival_seconds for r in one] != [r.arrival_seconds for r in other]
    assert repository_prefixes(SMALL) != repository_prefixes(RepositoryAssistantConfig(**{**vars(SMALL), "seed": 8}))


def test_request_shape():
    workload = generate_workload(SMALL)
    assert [r.index for r in workload] == list(range(SMALL.requests))
    for request in workload:
        assert isinstance(request, WorkloadRequest)
        assert [m["role"] for m in request.messages] == ["system", "user"]
        assert request.prefix == repository_prefix(SMALL, request.repository)
        assert request.max_tokens == SMALL.max_tokens
        assert 0 <= request.repository < SMALL.repositories


def test_prefix_depends_only_on_seed_and_bounds():
    """Asking for more requests or repositories does not change a repository's text."""
    bigger = RepositoryAssistantConfig(**{**vars(SMALL), "repositories": 20, "requests": 300, "rate": 9.0})
    assert repository_prefix(bigger, 3) == repository_prefix(SMALL, 3)


def test_arrivals_increase_at_the_given_rate():
    config = RepositoryAssistantConfig(repositories=4, requests=4000, rate=2.5, seed=1,
                                       prefix_min_tokens=50, prefix_max_tokens=60)
    arrivals = [r.arrival_seconds for r in generate_workload(config)]
    assert arrivals[0] > 0
    assert all(b > a for a, b in zip(arrivals, arrivals[1:]))
    gaps = [arrivals[0]] + [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / config.rate, rel=0.1)
    # exponential gaps: the standard deviation is about the mean
    assert statistics.stdev(gaps) == pytest.approx(1 / config.rate, rel=0.2)


def test_zipf_popularity():
    config = RepositoryAssistantConfig(repositories=8, requests=5000, seed=3, prefix_min_tokens=50,
                                       prefix_max_tokens=60)
    counts = Counter(r.repository for r in generate_workload(config))
    assert counts.most_common(1)[0][0] == 0
    assert set(counts) == set(range(config.repositories))  # mild skew: every repository comes up
    weights = zipf_weights(config.repositories, config.zipf_exponent)
    assert sum(weights) == pytest.approx(1)
    assert weights[0] / weights[-1] == pytest.approx(8 ** 0.3)
    assert counts[0] / config.requests == pytest.approx(weights[0], abs=0.03)
    assert counts[0] > 1.5 * counts[7]


def test_prefixes_of_different_repositories_share_no_long_text():
    prefixes = repository_prefixes(RepositoryAssistantConfig(repositories=6, prefix_min_tokens=1000,
                                                             prefix_max_tokens=1500, seed=11))
    for i in range(len(prefixes)):
        for j in range(i + 1, len(prefixes)):
            assert shares_substring(prefixes[i], prefixes[j], 48) is None, (i, j)
    # and they differ from the first characters on, so no KV block is shared across repositories
    assert len({p[:40] for p in prefixes}) == len(prefixes)


def test_lengths_within_bounds():
    config = RepositoryAssistantConfig(repositories=10, requests=300, seed=5)
    prefixes = repository_prefixes(config)
    for r, prefix in enumerate(prefixes):
        target = prefix_target_tokens(config, r)
        assert config.prefix_min_tokens <= target <= config.prefix_max_tokens
        assert target - 2 <= approx_tokens(prefix) <= target
        # characters: this pseudo-text runs at 2-4 characters a token
        assert 2 * config.prefix_min_tokens <= len(prefix) <= 4 * config.prefix_max_tokens
    questions = [r.question for r in generate_workload(config)]
    lengths = [approx_tokens(q) for q in questions]
    assert min(lengths) >= config.question_min_tokens and max(lengths) <= config.question_max_tokens
    assert all(5 <= len(q.split()) <= config.question_max_tokens for q in questions)
    assert len(set(questions)) == len(questions)  # short, and many per repository


def test_custom_token_counter_is_used():
    words = lambda text: len(text.split())  # noqa: E731
    config = RepositoryAssistantConfig(repositories=2, requests=10, prefix_min_tokens=300, prefix_max_tokens=300)
    for prefix in repository_prefixes(config, words):
        assert 290 <= words(prefix) <= 300
    for request in generate_workload(config, words):
        assert words(request.question) <= config.question_max_tokens


@pytest.mark.parametrize("field,value", [("repositories", 0), ("rate", 0.0), ("prefix_min_tokens", 0),
                                         ("question_max_tokens", 5), ("zipf_exponent", -1.0), ("max_tokens", 0)])
def test_invalid_config(field, value):
    with pytest.raises(ValueError):
        RepositoryAssistantConfig(**{field: value})
