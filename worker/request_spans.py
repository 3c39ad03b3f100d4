"""The spans of one generate on a worker (``foundation.tracing``), in the trace the
orchestrator's request context names::

    orchestrator: the API call
      ├─ kvroute.prefill   hold_blocks: the prompt computed here, its blocks leased (DISAGG, a PULL's lend)
      └─ kvroute.decode    every other generate: a DISAGG's decode, a PULL's sink, a LOCAL plan whole
           └─ kvroute.kv_pull   the blocks the connector pulled for it: bytes and seconds

The pull runs inside vLLM's model-worker process, which exports nothing: its span is
written here, from the record the connector kept (``wire.PullRecord``), with the times it
measured. While tracing is off a generate gets ``UNTRACED``, whose methods do nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

from foundation import tracing, wire

PREFILL, DECODE, KV_PULL = "kvroute.prefill", "kvroute.decode", "kvroute.kv_pull"


class RequestSpans:
    """Owned by the request's RPC task: ``observe`` each chunk sent, ``fail`` on an error, ``finish`` once."""

    def __init__(self, request: wire.GenerateRequest, model: str):
        attributes = {tracing.GEN_AI_OPERATION: "text_completion", tracing.GEN_AI_MODEL: Path(model).name,
                      tracing.GEN_AI_MAX_TOKENS: request.sampling.max_tokens,
                      tracing.GEN_AI_INPUT_TOKENS: len(request.prompt_token_ids),
                      "kvroute.request_id": request.request_id,
                      "kvroute.pull_from": request.pull_from.address if request.pull_from else None}
        self.span = tracing.start_span(PREFILL if request.hold_blocks else DECODE,
                                       tracing.remote_parent(request.trace_context), tracing.SERVER, attributes)
        self._started = time.perf_counter()
        self._output_tokens = 0
        self._error: BaseException | str | None = None

    def observe(self, chunk: wire.GenerateChunk) -> None:
        if chunk.token_ids and not self._output_tokens:
            self.span.set_attribute("kvroute.first_token_seconds", time.perf_counter() - self._started)
        self._output_tokens += len(chunk.token_ids)
        if chunk.transfer is not None:
            self._pulled(chunk.transfer)
        if chunk.finished:
            tracing.set_attributes(self.span, {tracing.GEN_AI_CACHE_READ_TOKENS: chunk.num_cached_tokens,
                                               tracing.GEN_AI_FINISH_REASONS: [chunk.finish_reason or "unknown"]})

    def _pulled(self, record: wire.PullRecord) -> None:
        # A consumer that does not report when its pull began: it ended at the latest now.
        ended_at = record.started_at + record.seconds if record.started_at else time.time()
        pull = tracing.start_span(KV_PULL, self.span, tracing.CLIENT, {
            "kvroute.transfer.bytes": record.num_bytes, "kvroute.transfer.seconds": record.seconds,
            "kvroute.transfer.source": record.source, "kvroute.transfer.ok": record.ok,
        }, start_time=ended_at - record.seconds)
        tracing.end_span(pull, None if record.ok else "pull_failed", end_time=ended_at)

    def fail(self, error: BaseException | str) -> None:
        self._error = error

    def finish(self) -> None:
        self.span.set_attribute(tracing.GEN_AI_OUTPUT_TOKENS, self._output_tokens)
        tracing.end_span(self.span, self._error)


class _Untraced:
    def observe(self, chunk: wire.GenerateChunk) -> None:
        pass

    def fail(self, error: BaseException | str) -> None:
        pass

    def finish(self) -> None:
        pass


UNTRACED = _Untraced()


def request_spans(request: wire.GenerateRequest, model: str) -> RequestSpans | _Untraced:
    return RequestSpans(request, model) if tracing.enabled() else UNTRACED
