"""The orchestrator's spans of one completion request (``foundation.tracing``)::

    chat <model> | text_completion <model>   SERVER: the API call, until its last byte is sent
      ├─ kvroute.placement     one per placement: the plan chosen, its estimates, the alternatives
      ├─ kvroute.prefill       on the prefill worker ─┐ their parent travels in each
      └─ kvroute.decode        on the decode worker  ─┘ GenerateRequest's trace_context
           └─ kvroute.kv_pull  (``worker.request_spans``)

A client's own ``traceparent`` header makes the API span a child of the client's span.
While tracing is off every span here is ``tracing.NO_SPAN`` and nothing is computed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping, Sequence

from foundation import tracing
from orchestrator.planner.views import Decision, Plan

PLACEMENT = "kvroute.placement"
CLIENT_GONE = "client_gone"  # the error.type of a request whose client left before its end
_NOTHING_TO_END = contextlib.nullcontext()  # reusable: an untraced request's whole cost of ``until_done``


class ApiCall:
    """The API span of one HTTP completion request (of one or more prompts, one job each).
    Its jobs' ``trace_span`` is set to it, so their placements and workers' spans join it."""

    def __init__(self, operation: str, route: str, model: str, jobs: Sequence, headers: Mapping[str, str]):
        self.span = tracing.start_span(f"{operation} {model}", tracing.remote_parent(headers), tracing.SERVER,
                                       _request_attributes(operation, route, model, jobs))
        for job in jobs:
            job.trace_span = self.span
        self._jobs = jobs
        self._error: BaseException | str | None = None

    def fail(self, error: BaseException) -> None:
        """The request failed (or its client left) after its response began."""
        gone = isinstance(error, (GeneratorExit, asyncio.CancelledError))
        self._error = CLIENT_GONE if gone else error

    def until_done(self, outcomes: Sequence):
        """Around the work of the response: the span ends with it, failed if it raises."""
        return self._until_done(outcomes) if self.span.is_recording() else _NOTHING_TO_END

    @contextlib.contextmanager
    def _until_done(self, outcomes: Sequence) -> Iterator[None]:
        try:
            yield
        except BaseException as error:
            self.fail(error)
            raise
        finally:
            self._end(outcomes)

    def _end(self, outcomes: Sequence) -> None:
        if self.span.is_recording():
            tracing.set_attributes(self.span, {
                tracing.GEN_AI_OUTPUT_TOKENS: sum(o.completion_tokens for o in outcomes),
                tracing.GEN_AI_CACHE_READ_TOKENS: sum(o.cached_tokens for o in outcomes),
                tracing.GEN_AI_FINISH_REASONS: [o.finish_reason or "none" for o in outcomes]})
        tracing.end_span(self.span, self._error)


def _request_attributes(operation: str, route: str, model: str, jobs: Sequence) -> dict:
    if not tracing.enabled():
        return {}
    return {tracing.GEN_AI_OPERATION: operation, tracing.GEN_AI_MODEL: model,
            tracing.GEN_AI_MAX_TOKENS: jobs[0].sampling.max_tokens, tracing.GEN_AI_RESPONSE_ID: jobs[0].response_id,
            tracing.GEN_AI_INPUT_TOKENS: sum(len(job.prompt_token_ids) for job in jobs),
            "http.request.method": "POST", "http.route": route, "kvroute.tenant": jobs[0].tenant,
            "kvroute.prompts": len(jobs)}


def placement_span(parent: tracing.Span, request_id: str):
    """Around one placement of a request (planning, and any wait for capacity); see ``describe``."""
    return tracing.span(PLACEMENT, parent, attributes={"kvroute.request_id": request_id})


def describe(span: tracing.Span, decision: Decision) -> None:
    """The placement's outcome: the plan chosen, what the planner estimated for it, and how
    many other plans it weighed (their estimates are in the decision record)."""
    if not span.is_recording():
        return
    chosen = decision.chosen
    others = [plan for plan in decision.alternatives if plan is not chosen]
    tracing.set_attributes(span, {"kvroute.policy": decision.policy, "kvroute.reason": decision.reason,
                                  "kvroute.alternatives": len(others),
                                  "kvroute.alternatives.feasible": sum(plan.feasible for plan in others),
                                  **(plan_attributes(chosen) if chosen else {})})


def plan_attributes(plan: Plan) -> dict:
    attributes = {"kvroute.plan.kind": plan.kind.value, "kvroute.plan.decode_worker": plan.decode_worker,
                  "kvroute.plan.prefill_worker": plan.prefill_worker,
                  "kvroute.plan.source_worker": plan.source_worker,
                  "kvroute.plan.lend_tokens": plan.lend_tokens if plan.source_worker else None}
    estimate = plan.estimate
    if estimate is not None:
        attributes |= {"kvroute.estimate.ttft_seconds": estimate.ttft, "kvroute.estimate.gap_seconds": estimate.gap,
                       "kvroute.estimate.queue_wait_seconds": estimate.queue_wait,
                       "kvroute.estimate.prefill_seconds": estimate.prefill,
                       "kvroute.estimate.transfer_seconds": estimate.transfer,
                       "kvroute.estimate.transfer_bytes": estimate.transfer_bytes,
                       "kvroute.estimate.reused_tokens": estimate.reused_tokens}
    return attributes
