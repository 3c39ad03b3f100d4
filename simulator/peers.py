"""What users run instead of kvroute, as simulated models: the peers a shape is judged against.

* **N aggregated replicas behind a prefix-hash router** (``PrefixHashRouter``): each request
  goes, whole, to the replica that a hash of its prompt's leading blocks names, as a
  consistent-hash or session-affinity router sends it; no KV ever moves between replicas,
  and the router never looks at load. Run it on a fleet of unified workers. (The SGLang-
  style router that falls back to the least loaded replica when loads drift apart is the
  planner's own ``prefix_affinity`` baseline, which on unified workers also serves each
  request on one replica.)
* **One engine per machine** (``one_engine_machine``): a single vLLM server spanning the
  machine's N engines' worth of hardware. Its step's per-token, attention and per-sequence
  terms are one engine's divided by N (perfect scaling: the peer's best case), its fixed
  terms one engine's (a step still synchronises once), and it has N engines' KV blocks;
  its token budget and sequence cap stay vLLM's defaults, as a user would start it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import replace

from foundation.identity import BlockHash
from orchestrator.planner.cost_model import CostModel
from orchestrator.planner.plans import local_plan
from orchestrator.planner.settings import PlannerSettings
from orchestrator.planner.views import Decision, RequestView, WorkerView
from simulator.calibration import SimCalibration
from simulator.engine import EngineConfig

PREFIX_HASH = "prefix_hash"
DEFAULT_LEADING_BLOCKS = 4  # 64 tokens at the simulator's 16-token blocks: a system prompt's head


def replica_of(leading: Sequence[BlockHash], replicas: int) -> int:
    """The replica a prompt whose first blocks are ``leading`` goes to: a stable hash, mod N."""
    digest = hashlib.blake2b(repr(list(leading)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % replicas


class PrefixHashRouter:
    """Sends every request LOCAL to the replica its prompt's leading blocks hash to (a prompt
    shorter than a block goes to the first replica). Reads the prompt through ``bind_prompts``,
    which the simulation calls with a lookup from request id to the prompt's block hashes."""

    name = PREFIX_HASH

    def __init__(self, settings: PlannerSettings | None = None, leading_blocks: int = DEFAULT_LEADING_BLOCKS):
        self.settings = settings or PlannerSettings()
        self.leading_blocks = leading_blocks
        self._prompt_of: Callable[[str], list[BlockHash]] | None = None

    def bind_prompts(self, prompt_of: Callable[[str], list[BlockHash]]) -> None:
        self._prompt_of = prompt_of

    def decide(self, request: RequestView, prefill: list[WorkerView], decode: list[WorkerView],
               model: CostModel) -> Decision:
        if not decode:
            return Decision(self.name, None, (), "no feasible plan: no replica")
        if self._prompt_of is None:
            raise RuntimeError("the prefix-hash router reads prompts: the simulation must bind them")
        leading = self._prompt_of(request.request_id)[:self.leading_blocks]
        position = replica_of(leading, len(decode)) if leading else 0
        replica = sorted(decode, key=lambda worker: worker.worker_id)[position]
        plan = local_plan(request, replica, model, self.settings)
        reason = f"LOCAL {replica.worker_id}: the hash of the prompt's first {len(leading)} blocks"
        if not plan.feasible:
            reason += f"; routed anyway: {plan.infeasible_reason}"
        return Decision(self.name, plan, (plan,), reason)


def one_engine_machine(calibration: SimCalibration, engine: EngineConfig,
                       engines: int) -> tuple[SimCalibration, EngineConfig]:
    """The curves and limits of one engine spanning ``engines`` engines' hardware (see above)."""
    faster = replace(calibration,
                     prefill_per_token_seconds=calibration.prefill_per_token_seconds / engines,
                     prefill_attention_seconds=calibration.prefill_attention_seconds / engines,
                     decode_per_sequence_seconds=calibration.decode_per_sequence_seconds / engines)
    return faster, replace(engine, num_blocks=engine.num_blocks * engines)
