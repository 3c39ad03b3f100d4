"""One workload on clusters of different sizes, scaled so every worker sees the same load.

* **repository-assistant** (``scale_repository_assistant``): a config made for
  ``reference_prefill`` prefill workers, at ``num_prefill``: repositories and arrival rate
  in proportion to the prefill workers. Each prefill worker then gets the same request
  rate and the same share of the prefix working set; with an unchanged KV cache per
  engine that is the same cache pressure. The request count is the caller's: what the
  run can afford. Fewer requests per repository mean more of them are first requests,
  which miss at any placement.
* **trace** (``trace_time_scale``): a trace's requests and prefixes are fixed, so only
  its clock can change. The time scale gives each prefill worker the cold-prefill load
  (prefill seconds the prompts would cost with nothing cached, under the calibration in
  use, per second) that the trace at time scale 1.0 puts on ``reference_prefill`` (4)
  prefill workers under ``reference`` (the default curves): with the default curves it
  is ``reference_prefill / num_prefill``, so 0.008 on 500 + 500 workers loads each
  worker as 1.0 does on 4 + 4. Cache pressure is not kept: the trace's working set is
  fixed, and from 64 workers on it fits the cluster's caches whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from simulator.calibration import SimCalibration
from workloads import RepositoryAssistantConfig

REFERENCE_TRACE_PREFILL = 4  # kvroute bench simulate's default cluster: 4 prefill + 4 decode


def scale_repository_assistant(config: RepositoryAssistantConfig, reference_prefill: int, num_prefill: int,
                               requests: int) -> RepositoryAssistantConfig:
    """``config`` (made for ``reference_prefill`` prefill workers) at ``num_prefill``, with ``requests``."""
    factor = num_prefill / reference_prefill
    return replace(config, repositories=max(1, round(config.repositories * factor)),
                   rate=config.rate * factor, requests=requests)


def cold_prefill_seconds(prompt_tokens: Iterable[int], calibration: SimCalibration) -> float:
    """Prefill seconds of the prompts with nothing cached, each in one step."""
    return sum(calibration.step_seconds([(tokens, 0)], 0) for tokens in prompt_tokens)


def trace_time_scale(prompt_tokens: Iterable[int], num_prefill: int, calibration: SimCalibration,
                     reference: SimCalibration = SimCalibration(),
                     reference_prefill: int = REFERENCE_TRACE_PREFILL) -> float:
    """The time scale at which ``num_prefill`` workers carry the cold-prefill load per worker
    that time scale 1.0 puts on ``reference_prefill`` workers under ``reference``."""
    prompts = list(prompt_tokens)
    slowdown = cold_prefill_seconds(prompts, calibration) / cold_prefill_seconds(prompts, reference)
    return reference_prefill / num_prefill * slowdown
