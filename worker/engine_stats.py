"""What the engine tells us about its load, captured from vLLM's stat-logger hook.

vLLM calls ``record`` from its output-handling task after every engine step, in the
worker process, so one writer updates ``EngineStats`` and readers see whole values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm.v1.metrics.loggers import StatLoggerBase

from foundation.wire import PromptTokenCounters


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_computed: int = 0
    prompt_local_cache_hit: int = 0
    prompt_external: int = 0
    last_step_end: float = float("-inf")  # time.monotonic() when the engine last finished a step

    def prompt_tokens(self) -> PromptTokenCounters:
        return PromptTokenCounters(computed=self.prompt_computed,
                                   local_cache_hit=self.prompt_local_cache_hit,
                                   external_kv_transfer=self.prompt_external)

    def logger_factory(self):
        """A vLLM ``StatLoggerFactory`` whose loggers write into this object."""
        stats = self

        class _Recorder(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                stats.observe(scheduler_stats, iteration_stats)

            def log_engine_initialized(self):
                pass

        return _Recorder

    def observe(self, scheduler_stats, iteration_stats) -> None:
        self.last_step_end = time.monotonic()
        if scheduler_stats is not None:
            self.num_running = scheduler_stats.num_running_reqs
            self.num_waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            prompt = iteration_stats.prompt_token_stats
            self.prompt_computed += prompt.computed
            self.prompt_local_cache_hit += prompt.local_cache_hit
            self.prompt_external += prompt.external_kv_transfer
