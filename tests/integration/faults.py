"""Streams to kill workers under, for the fault tests with synthetic workers."""

from __future__ import annotations

import signal

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 40


def stream(client, prompt: str):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     stream=True, stream_options={"include_usage": True},
                                     extra_body={"ignore_eos": True})


def kill(stack, worker_id: str) -> None:
    stack.worker_processes[worker_id].send_signal(signal.SIGKILL)
    stack.worker_processes[worker_id].wait(10)
