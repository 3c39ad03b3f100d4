"""An orchestrator that dies mid-stream leaves no work behind on its workers: their next
chunk for it cannot be delivered, so they abort the request instead of running it to
``max_tokens`` for nobody. Real processes (synthetic-engine workers, as in
``test_worker_faults``)."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from foundation.model_prep import resolve_model
from orchestrator.worker_client import WorkerClient
from testing.stack import running_synthetic_stack

MODEL = "SmolLM2-135M-Instruct"


async def active_requests(address: str) -> int:
    client = WorkerClient(address)
    try:
        return (await client.stats()).num_active_requests
    finally:
        await client.close()


def test_requests_of_a_dead_orchestrator_are_aborted_on_the_workers(tmp_path):
    with running_synthetic_stack(resolve_model(None), tmp_path / "stack.log", ["--policy", "least_loaded"],
                                 token_seconds=0.05, roles=("prefill", "decode")) as stack:
        decode = next(w for w in httpx.get(stack.url + "/admin/workers", timeout=5).json()["workers"]
                      if w["role"] == "decode")
        body = {"model": MODEL, "prompt": "An orchestrator dies while this streams.", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(6):  # a few tokens from the decode worker: the request runs there
                next(line for line in lines if line.startswith("data: "))
            assert asyncio.run(active_requests(decode["rpc_address"])) == 1
            stack.process.send_signal(signal.SIGKILL)
            stack.process.wait(10)
        # 400 tokens at 50 ms would run for 20 s; the abort comes with the next token.
        deadline = time.monotonic() + 5
        while (active := asyncio.run(active_requests(decode["rpc_address"]))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert active == 0, "the decode worker still runs the dead orchestrator's request"
        assert "its caller is gone; aborting it" in (tmp_path / "stack.log").read_text()
