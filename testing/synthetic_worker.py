"""A worker process with a synthetic engine: the real RPC server and heartbeats, no model.

For measuring what the orchestrator itself costs, and for load tests of the frontend:
the engine answers after a fixed, configurable time per prompt token and per output
token, so a run through the orchestrator and a run straight to the worker differ only
by the orchestrator's own work, not by engine jitter. Generated token ids are a pure
function of the prompt and position (deterministic, checkable). It reports the model
fingerprint of ``--model``, so an orchestrator serving that model accepts it. It holds
no KV cache: a prefill's pull source names a lease nobody serves, and a decode ignores
it, as a real consumer would after a failed pull; or, with ``--pull-bytes-per-second``, it
acts out the pull: it waits as long as the prompt's blocks would take at that speed and
reports the pull (bytes and seconds) as a real consumer's connector does, so that the
orchestrator's transfer metrics and link calibration see traffic.

Usage::

    python -m testing.synthetic_worker --role prefill --model DIR --orchestrator tcp://HOST:PORT
        [--prefill-seconds-per-token 0.0001] [--token-seconds 0.005] [--drain-seconds 30]
        [--pull-bytes-per-second 0] [--ready-file PATH] [--status-file PATH]
        [--otlp-endpoint URL [--otlp-protocol http|grpc]]

SIGTERM drains it as it drains a real worker (``worker.drain``); SIGINT stops it.

Like a real worker, its heartbeats list the prompts it accepted and has not answered yet,
and how long the oldest has gone without an engine step ending. The engine computes a
prompt in steps of at most ``STEP_SECONDS``, as vLLM's chunked prefill does, so a long
prompt shows steps ending while it computes.

Failure injection, for fault tests: SIGUSR1 toggles failing. While failing, the worker
stays registered and heartbeating but answers every generate with an engine error, as
a worker with a broken engine would; a second SIGUSR1 makes it healthy again. SIGUSR2
toggles hanging: the engine stops stepping (requests get no token, heartbeats go on),
as a wedged engine would; a second SIGUSR2 lets it go on.

Not a serving path: nothing here computes anything a client should read.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from foundation import tracing, wire, zmq_auth
from foundation.log_setup import LOG_FORMAT
from foundation.model_fingerprint import model_fingerprint
from foundation.netutil import flush_async_context
from transfer.request_params import PARAMS_KEY, prompt_digest
from worker.drain import Drain, StopSignals, serve_until_stopped
from worker.heartbeat import HeartbeatSender, heartbeat_of
from worker.node_store_link import NodeStoreLink
from worker.queued_prefill import head_prompt_age, queued_prefill
from worker.resident import ResidentBlocks
from worker.rpc_server import RpcServer
from worker.settings import WorkerSettings
from worker.status_file import status_writer

logger = logging.getLogger("kvroute.worker.synthetic")

NUM_BLOCKS = 4096
BLOCK_SIZE = 128
BYTES_PER_BLOCK = 5_898_240  # SmolLM2-135M in float32: 46,080 bytes a token
STEP_SECONDS = 0.1  # longest synthetic engine step: a longer prefill takes several


@dataclass(frozen=True)
class SyntheticTiming:
    prefill_seconds_per_token: float = 0.0001
    token_seconds: float = 0.005  # per output token after the first
    pull_bytes_per_second: float = 0.0  # 0: a decode ignores its pull source


def synthetic_next_token(context: list[int]) -> int:
    """The next token as a pure function of everything before it, like greedy decoding:
    continuing from prompt + the tokens so far gives the same tokens as an unbroken run."""
    return 100 + (sum(context[-8:]) * 31 + len(context)) % 1000


@dataclass
class _Completion:
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: None = None


@dataclass
class _Output:
    """The fields of vLLM's RequestOutput that ``generation.to_chunk`` reads."""

    outputs: list[_Completion]
    finished: bool
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None


@dataclass
class SyntheticEngine:
    timing: SyntheticTiming
    transfer_address: str
    failing: bool = False  # failure injection: every generate raises (see the module docstring)
    pulls: dict[str, wire.PullRecord] = field(default_factory=dict)  # acted-out pulls, until reported
    last_step_end: float = field(default_factory=time.monotonic)
    priorities: dict[str, int] = field(default_factory=dict)  # each request's, as the worker gave it
    _running: asyncio.Event = field(default_factory=asyncio.Event)  # cleared while hanging

    def __post_init__(self):
        self._running.set()

    def toggle_failing(self) -> None:
        self.failing = not self.failing
        logger.warning("failure injection %s", "on: failing every request" if self.failing else "off: healthy")

    def toggle_hanging(self) -> None:
        if self._running.is_set():
            self._running.clear()
            logger.warning("failure injection on: the engine stops stepping")
        else:
            self._running.set()
            logger.warning("failure injection off: the engine steps again")

    async def _step(self, seconds: float) -> None:
        await self._running.wait()
        await asyncio.sleep(seconds)
        await self._running.wait()  # a step under way when the engine hung ends when it goes on
        self.last_step_end = time.monotonic()

    async def generate(self, prompt: dict, params, request_id: str, priority: int = 0):
        """Every request runs at once (no queue for ``priority`` to order); it is recorded."""
        self.priorities[request_id] = priority
        if self.failing:
            raise RuntimeError("injected failure (SIGUSR1)")
        tokens = list(prompt["prompt_token_ids"])
        context = list(tokens)
        prefill = self.timing.prefill_seconds_per_token * len(tokens)
        while prefill > 0:
            await self._step(min(prefill, STEP_SECONDS))
            prefill -= STEP_SECONDS
        transfer = (params.extra_args or {}).get("kv_transfer_params", {}).get(PARAMS_KEY, {})
        if transfer.get("pull_from") and self.timing.pull_bytes_per_second > 0:
            await self._act_out_pull(request_id, wire.from_dict(transfer["pull_from"], wire.PullSource))
        for position in range(params.max_tokens):
            if position:
                await self._step(self.timing.token_seconds)
            last = position == params.max_tokens - 1
            context.append(synthetic_next_token(context))
            output = _Output([_Completion([context[-1]], "length" if last else None)],
                             finished=last, prompt_token_ids=tokens)
            if last and transfer.get("hold_blocks"):
                output.kv_transfer_params = {PARAMS_KEY: {"pull_source": wire.to_dict(self._source(prompt))}}
            yield output

    async def _act_out_pull(self, request_id: str, source: wire.PullSource) -> None:
        num_bytes = -(-source.num_tokens // source.block_size) * BYTES_PER_BLOCK
        seconds = num_bytes / self.timing.pull_bytes_per_second
        started_at = time.time()
        await asyncio.sleep(seconds)
        self.pulls[request_id] = wire.PullRecord(request_id, source.address, num_bytes, seconds, ok=True,
                                                 started_at=started_at)

    def _source(self, prompt: dict) -> wire.PullSource:
        tokens = prompt["prompt_token_ids"]
        return wire.PullSource(handle=secrets.token_hex(16), address=self.transfer_address,
                               num_tokens=len(tokens), block_size=BLOCK_SIZE,
                               prompt_digest=prompt_digest(tokens, prompt.get("cache_salt")))

    async def abort(self, request_id: str) -> None:
        return None


class SyntheticWorker:
    def __init__(self, settings: WorkerSettings, timing: SyntheticTiming, ready_file: Path | None):
        self.settings = settings.with_ports()
        self.engine = SyntheticEngine(timing, self.settings.transfer_address)
        self.fingerprint = model_fingerprint(self.settings.model)
        # A real node store, which this worker reports and resets as a real worker does (its
        # synthetic engine neither reads nor writes blocks there).
        self.node_store = NodeStoreLink(self.settings.node_store)
        self.resident = ResidentBlocks()
        self.ready_file = ready_file
        self.server: RpcServer | None = None

    def load(self) -> wire.WorkerLoad:
        active = self.server.num_active_requests if self.server else 0
        waiting = self.server.prompts_waiting if self.server else {}
        queued = queued_prefill(waiting, self.resident)
        return wire.WorkerLoad(num_running=active, num_waiting=0, num_queued_prefill_tokens=sum(queued.values()),
                               queued_prefill=queued,
                               head_prompt_age=head_prompt_age(waiting, self.engine.last_step_end, time.monotonic()),
                               num_free_blocks=NUM_BLOCKS, num_total_blocks=NUM_BLOCKS,
                               block_size=BLOCK_SIZE, bytes_per_block=BYTES_PER_BLOCK)

    def heartbeat(self, now: float) -> wire.Heartbeat:
        return heartbeat_of(self.settings, self.load(), self.fingerprint, now, draining=self.draining())

    def draining(self) -> bool:
        return self.server is not None and self.server.draining

    def engine_problem(self) -> str:
        return "injected failure (SIGUSR1)" if self.engine.failing else ""

    async def stats(self) -> wire.WorkerStats:
        s = self.settings
        return wire.WorkerStats(worker_id=s.worker_id, role=s.role, incarnation=s.incarnation, load=self.load(),
                                transfer=wire.TransferCounters(),
                                prompt_tokens=wire.PromptTokenCounters(),
                                num_active_requests=self.server.num_active_requests if self.server else 0,
                                **await self.node_store.stats_fields())

    async def reset_cache(self, request_id: str) -> wire.ResetCacheReply:
        store = await self.node_store.reset_fields()
        return wire.ResetCacheReply(request_id=request_id, reset=True, released_leases=0, **store)

    async def transfer_of(self, request_id: str) -> wire.PullRecord | None:
        return self.engine.pulls.pop(request_id, None)

    async def run(self) -> None:
        signals = StopSignals()
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self.engine.toggle_failing)
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, self.engine.toggle_hanging)
        s = self.settings
        self.server = RpcServer(self.engine, f"tcp://{s.bind_host}:{s.rpc_port}", self.stats,
                                lambda request_id: self.resident.snapshot(request_id, s.incarnation),
                                self.reset_cache, self.transfer_of, model=s.model,
                                tier_events=self.node_store.events)
        heartbeats = HeartbeatSender(s.orchestrators, self.heartbeat, s.orchestrator_resolve_seconds,
                                     status_writer(s, self.engine_problem, self.draining))
        tasks = [asyncio.create_task(self.server.serve()),
                 asyncio.create_task(heartbeats.run(s.heartbeat_seconds))]
        logger.info("synthetic %s worker %s at %s", s.role, s.worker_id, s.rpc_address)
        if self.ready_file is not None:
            self.ready_file.write_text(s.rpc_address)
        # Its pull sources name leases nobody holds: nothing to wait for beyond its requests.
        await serve_until_stopped(tasks, signals, Drain(self.server, heartbeats, s.drain_seconds))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A kvroute worker with a synthetic engine (benchmarks, load tests).")
    parser.add_argument("--role", choices=wire.ROLES, required=True)
    parser.add_argument("--model", required=True, help="model folder whose fingerprint the worker reports")
    parser.add_argument("--orchestrator", action="append", required=True, help="registration address; repeatable")
    parser.add_argument("--worker-id", default="", help="default: role and a random suffix")
    parser.add_argument("--prefill-seconds-per-token", type=float, default=SyntheticTiming.prefill_seconds_per_token)
    parser.add_argument("--token-seconds", type=float, default=SyntheticTiming.token_seconds)
    parser.add_argument("--drain-seconds", type=float, default=WorkerSettings.drain_seconds,
                        help="on SIGTERM, wait this long at most for running requests (default: %(default)s)")
    parser.add_argument("--pull-bytes-per-second", type=float, default=SyntheticTiming.pull_bytes_per_second,
                        help="a decode acts out the pull of its prompt's blocks at this speed and reports it "
                             "(default: %(default)s, ignore pull sources)")
    parser.add_argument("--ready-file", type=Path, default=None, help="written with the RPC address once serving")
    parser.add_argument("--status-file", default="", help="health for `kvroute probe worker`, as a real worker's")
    parser.add_argument("--node-store", default="", help="a node store this worker reports and resets")
    zmq_auth.add_security_arguments(parser)
    tracing.add_tracing_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    zmq_auth.configure_from_flags(args.cluster_keys, args.insecure_no_auth, "worker",
                                  args.transfer_encryption == "on")
    settings = WorkerSettings(role=args.role, model=args.model, orchestrators=tuple(args.orchestrator),
                              worker_id=args.worker_id, drain_seconds=args.drain_seconds,
                              status_file=args.status_file, otlp_endpoint=args.otlp_endpoint,
                              otlp_protocol=args.otlp_protocol, node_store=args.node_store).with_ports()
    settings.configure_tracing()
    timing = SyntheticTiming(args.prefill_seconds_per_token, args.token_seconds, args.pull_bytes_per_second)
    try:
        asyncio.run(SyntheticWorker(settings, timing, args.ready_file).run())
    finally:
        flush_async_context()
        tracing.shutdown()


if __name__ == "__main__":
    main()
    # Stopped cleanly: skip the interpreter's teardown. Collecting the modules vLLM and torch
    # bring in (for SamplingParams) takes seconds of CPU, which would stand between a
    # drained worker and its exit, and every fault test's teardown.
    logging.shutdown()
    os._exit(0)
