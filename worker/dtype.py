"""Choosing the engine dtype when the user leaves it at ``auto``.

bfloat16 halves KV bytes and is what the model ships in, but on a CPU without native
bf16 instructions (AVX512-BF16 or AMX on x86, BF16 on Arm) vLLM falls back to a slow
matmul path: a 1k-token prefill of SmolLM2 took ~29 s in bfloat16 against ~1 s in
float32 on an AVX2-only machine. So ``auto`` means bfloat16 on GPUs and on CPUs that
have the instructions, float32 elsewhere.
"""

from __future__ import annotations

from pathlib import Path

AUTO = "auto"
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str) -> set[str]:
    """Feature flags of the first CPU in a /proc/cpuinfo text (x86 "flags", Arm "Features")."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def resolve_dtype(requested: str, cuda_available: bool, cpuinfo: str) -> str:
    if requested != AUTO:
        return requested
    if cuda_available or cpu_flags(cpuinfo) & BF16_CPU_FLAGS:
        return "bfloat16"
    return "float32"


def resolve_here(requested: str) -> str:
    """``resolve_dtype`` for this machine."""
    if requested != AUTO:
        return requested
    import torch

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    return resolve_dtype(requested, torch.cuda.is_available(), cpuinfo)
