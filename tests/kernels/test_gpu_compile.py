"""Every Triton kernel compiles for Hopper and Ampere, in the configurations a GPU run launches,
without register spills and within the GPUs' shared memory: checked here, without a GPU.

`tests/kernels/gpu_compile.py` (run in a subprocess: it needs Triton's interpreter off) calls each
launch wrapper with meta tensors, intercepts the launch, and compiles the kernel with Triton's own
pipeline to a cubin (the ptxas that ships with Triton). The interpreter tests prove the kernels
compute the right thing; this proves the same source builds for the real targets and that the
chosen tile sizes fit the register file, which only a GPU run would otherwise reveal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# The most dynamic shared memory one block may use (CUDA programming guide, per architecture).
MAX_SHARED = {"sm_90a": 227 * 1024, "sm_80": 163 * 1024}


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90).path  # noqa: B018 (raises when the bundled ptxas is missing)
    except Exception as error:  # pragma: no cover - platforms without Triton's NVIDIA backend
        pytest.skip(f"Triton's NVIDIA backend (ptxas) is not available here: {error}")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "kernels" / "gpu_compile.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_for_hopper_and_ampere(compiled: list[dict]) -> None:
    kernels = {(row["kernel"], row["arch"]) for row in compiled}
    for kernel in (
        "_store_kv_kernel",
        "_unified_attention_kernel",
        "_decode_split_kernel",
        "_merge_splits_kernel",
        "_rms_norm_kernel",
        "_rotary_kernel",
        "_silu_and_mul_kernel",
    ):
        assert (kernel, "sm_90a") in kernels and (kernel, "sm_80") in kernels, kernel
    # float8 KV caches compile for Hopper (Ampere has no e4m3 conversions: the runner refuses it).
    assert any("fp8" in row["case"] and row["arch"] == "sm_90a" for row in compiled)
    # Quantized linear layers: int4 on both, FP8 (activations and GEMM) on Hopper.
    for kernel in ("_int4_gemv_kernel", "_int4_matmul_kernel", "_int4_dequantize_kernel"):
        assert (kernel, "sm_90a") in kernels and (kernel, "sm_80") in kernels, kernel
    for kernel in ("_quantize_per_token_kernel", "_fp8_gemm_kernel"):
        assert (kernel, "sm_90a") in kernels, kernel


def test_no_register_spills(compiled: list[dict]) -> None:
    spilling = [row for row in compiled if row["spill_stores"] or row["spill_loads"]]
    assert not spilling, "\n".join(json.dumps(row) for row in spilling)


def test_shared_memory_fits(compiled: list[dict]) -> None:
    too_big = [row for row in compiled if row["shared"] > MAX_SHARED[row["arch"]]]
    assert not too_big, "\n".join(json.dumps(row) for row in too_big)
