"""The engine dtype behind ``auto``: bfloat16 only where the hardware computes it natively."""

from __future__ import annotations

import pytest

from worker.dtype import cpu_flags, resolve_dtype

AVX2_ONLY = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("requested, cuda, cpuinfo, expected", [
    ("auto", False, AVX2_ONLY, "float32"),  # bf16 matmuls fall back to a slow path here
    ("auto", False, SAPPHIRE_RAPIDS, "bfloat16"),
    ("auto", False, GRAVITON3, "bfloat16"),
    ("auto", True, AVX2_ONLY, "bfloat16"),  # the GPU computes, not the host CPU
    ("auto", False, "", "float32"),  # nothing known: the safe choice
    ("bfloat16", False, AVX2_ONLY, "bfloat16"),  # an explicit choice is never overridden
    ("float16", True, SAPPHIRE_RAPIDS, "float16"),
])
def test_resolve_dtype(requested, cuda, cpuinfo, expected):
    assert resolve_dtype(requested, cuda, cpuinfo) == expected


def test_cpu_flags_reads_the_first_cpu():
    assert cpu_flags(AVX2_ONLY) == {"fpu", "sse2", "avx", "avx2", "fma"}
    assert "bf16" in cpu_flags(GRAVITON3)
    assert cpu_flags("no flags here") == set()
