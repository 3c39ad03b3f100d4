"""Probe how engines bound to one CPU core share it: a short prefill on the decode worker
while a prefill worker bound to the same core (or to the other one) computes a long prompt.

Three workers as ``kvroute serve`` places them on two cores: prefill A on core 0,
prefill B on core 1, decode D on core 0. D first caches a 768-token prefix; each probe
then asks D for that prefix plus 34 new tokens (one short prefill step) one second after
A, B or neither started a cold 1,300-token prompt, and times D's first token. With fair
sharing of core 0, "A busy" should cost D about twice "idle" and A about D's share more
than A alone; "B busy" about nothing. Unfair sharing shows as one of the two barely
slowed and the other waiting for it.

The run is made twice, side by side: workers each in a session of their own (as the
launcher once started them) and in the launcher's session (``foundation.launcher.spawn``).
Linux's scheduler autogroups share CPU between sessions first, which starved D in the
first layout. Results go to ``--output``/results.json; a table is printed.

Usage::

    kvroute bench core-sharing [--output DIR] [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from pathlib import Path

from rich.console import Console

from foundation import wire
from foundation.launcher import launch_worker, stop_all
from foundation.model_prep import resolve_model
from kvroute.bench.command import Command
from kvroute.bench.progress import track
from kvroute.bench.run_keys import speaking_to_workers
from orchestrator.worker_client import WorkerClient

ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-gib", "0.3", "--max-model-len", "4096"]
LAYOUT = [("prefill", "0"), ("prefill", "1"), ("decode", "0")]  # kvroute serve's, on two cores
PREFIX_TOKENS, TAIL_TOKENS, BUSY_PROMPT_TOKENS = 768, 34, 1300
BUSY_HEAD_START_SECONDS = 1.0


class Prompts:
    def __init__(self, seed: int):
        self._random = random.Random(seed)

    def tokens(self, count: int) -> list[int]:
        return [self._random.randrange(1000, 40000) for _ in range(count)]


async def first_token_seconds(client: WorkerClient, prompt: list[int]) -> float:
    request = wire.GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, cache_salt="probe",
                                   sampling=wire.SamplingSpec(max_tokens=1, ignore_eos=True))
    started = time.monotonic()
    async for chunk in client.generate(request, timeout=300):
        if chunk.token_ids:
            return time.monotonic() - started
    raise RuntimeError("the stream ended without a token")


async def probe_layout(own_session: bool, repeats: int, log_dir: Path) -> dict[str, list[float]]:
    model = resolve_model(None, progress=True)
    workers = [launch_worker(role, ["--model", model, *ENGINE_ARGS, "--omp-threads-bind", core], log_dir,
                             own_session=own_session) for role, core in LAYOUT]
    try:
        for worker in workers:
            worker.wait_ready(600)
        a, b, d = clients = [WorkerClient(worker.rpc_address) for worker in workers]
        prompts = Prompts(seed=0)
        prefix = prompts.tokens(PREFIX_TOKENS)
        await first_token_seconds(d, prefix + prompts.tokens(TAIL_TOKENS))  # caches the prefix
        for client in (a, b):
            await first_token_seconds(client, prompts.tokens(200))  # first-request warm-up
        results: dict[str, list[float]] = {
            "neighbour alone": [await first_token_seconds(a, prompts.tokens(BUSY_PROMPT_TOKENS))]}
        for label, busy in (("idle", None), ("same core busy", a), ("other core busy", b)):
            for _ in range(repeats):
                neighbour = busy and asyncio.create_task(first_token_seconds(busy, prompts.tokens(BUSY_PROMPT_TOKENS)))
                await asyncio.sleep(BUSY_HEAD_START_SECONDS)
                results.setdefault(label, []).append(await first_token_seconds(d, prefix + prompts.tokens(TAIL_TOKENS)))
                if neighbour:
                    results.setdefault(f"neighbour, {label}", []).append(await neighbour)
        for client in clients:
            await client.close()
        return results
    finally:
        stop_all(workers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="results/probe_core_sharing")
    parser.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    report = {}
    layouts = (("own sessions", True), ("launcher's session", False))
    for name, own_session in track(layouts, "worker layouts", Console(), name=lambda layout: layout[0]):
        with speaking_to_workers():
            runs = asyncio.run(probe_layout(own_session, args.repeats, output / "workers"))
        medians = {label: statistics.median(times) for label, times in runs.items()}
        report[name] = {"seconds": runs, "median_seconds": medians,
                        "same_core_busy_over_idle": medians["same core busy"] / medians["idle"],
                        "neighbour_same_core_over_alone": medians["neighbour, same core busy"]
                        / medians["neighbour alone"]}
        print(f"{name}:\n  D's short prefill: " + ", ".join(f"{label} {' '.join(f'{t:.2f}' for t in runs[label])} s"
                                                       for label in ("idle", "same core busy", "other core busy"))
              + f"\n  A's long prefill: alone {medians['neighbour alone']:.2f} s, beside D on its core "
              + " ".join(f"{t:.2f}" for t in runs["neighbour, same core busy"]) + " s", flush=True)
    (output / "results.json").write_text(json.dumps(report, indent=2))
    return 0


COMMAND = Command("core-sharing", "how engines bound to one CPU core share it (a probe of the launcher's layout)",
                  __doc__, add_arguments, run)
parse_args, main = COMMAND.parse_args, COMMAND.main
