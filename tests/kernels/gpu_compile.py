"""Compile every Triton kernel for NVIDIA GPUs on a machine without one.

Run as `python tests/kernels/gpu_compile.py [case substring]` (it must start before any kernel
is defined, with the interpreter off). Each launch wrapper is called with meta tensors (shapes,
dtypes and strides, no data) in the configurations it picks on a GPU; the launch is intercepted,
and the kernel is compiled by Triton's own pipeline to PTX and, with the ptxas that ships with
Triton, to a cubin for Hopper (sm_90a) and Ampere (sm_80, except float8, which it lacks).
`ptxas -v` then gives registers, spills and shared memory. Prints one JSON object per compiled kernel.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
}
ARCHES = ((90, "sm_90a"), (80, "sm_80"))
_launches: list[tuple[str, JITFunction, tuple[Any, ...], dict[str, Any]]] = []
_current = ""


def _record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
    _launches.append((_current, self, args, kwargs))


JITFunction.run = _record  # type: ignore[method-assign]


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _launch_all(only: str = "") -> None:
    """Every wrapper, in the configurations a GPU run uses (Llama-3-8B and Qwen3 shapes)."""
    from kvasir.kernels.triton_ops import (
        activation,
        decode_attention,
        fp8_gemm,
        fp8_quant,
        int4_matmul,
        norm,
        rotary,
        store_kv,
    )
    from kvasir.kernels.triton_ops import unified_attention as unified

    # Pretend the meta tensors live on a GPU, so the wrappers pick the GPU's tile sizes.
    unified.gpu_tiles = decode_attention.gpu_tiles = lambda t: True  # type: ignore[attr-defined]
    int4_matmul.gpu_tiles = lambda t: True  # type: ignore[attr-defined]
    int4_matmul.sm_count = lambda device: 132  # type: ignore[attr-defined]  # an H100 SXM
    fp8_gemm.gpu_tiles = lambda t: True  # type: ignore[attr-defined]
    fp8_gemm.sm_count = lambda device: 132  # type: ignore[attr-defined]
    int4_matmul.DEQUANT_MIN_ROWS = 10**9  # type: ignore[attr-defined]  # compile the tl.dot path at M=512 too

    def case(name: str, wrapper: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        global _current
        if only and only not in name:
            return
        _current = name
        wrapper(*args, **kwargs)

    tokens, hq, hkv, d, blocks, bs = 64, 32, 8, 128, 512, 16
    table, lens = _meta(tokens, 64, dtype=torch.int32), _meta(tokens, dtype=torch.int32)
    starts, slots = _meta(tokens + 1, dtype=torch.int32), _meta(tokens, dtype=torch.int64)
    layouts = [
        (torch.bfloat16, torch.bfloat16),  # float16 compiles to the same code
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float8_e4m3fn),
    ]
    for dt, kv_dt in layouts:
        tag = f"{_TYPES[dt]}/{_TYPES[kv_dt]}"
        cache = _meta(blocks, bs, hkv, d, dtype=kv_dt)
        q = _meta(tokens, hq, d, dtype=dt)
        kv = _meta(tokens, hkv, d, dtype=dt)
        fp8 = {"k_scale": 0.5, "v_scale": 0.5} if kv_dt == torch.float8_e4m3fn else {}
        attention = (q, q, cache, cache, table, lens, starts, 0.088)  # out, q, caches, metadata, scale
        case(f"store_kv {tag}", store_kv.store_kv, kv, kv, cache, cache, slots, **fp8)
        for max_q in (1, 16, 2048):  # decodes in a mixed batch, short chunks, long prompts
            case(
                f"unified {tag} max_query_len={max_q}",
                unified.unified_attention,
                *attention,
                None,
                max_q,
                **fp8,
            )
        case(f"unified {tag} window", unified.unified_attention, *attention, 4096, 2048, **fp8)
        for splits in (1, 8):
            case(
                f"decode {tag} splits={splits}",
                decode_attention.decode_attention,
                *attention,
                None,
                splits,
                **fp8,
            )
    # Qwen3's head layout (16 q / 8 kv heads: a group of 2) with head dim 64.
    cache, q = _meta(blocks, bs, 8, 64), _meta(tokens, 16, 64)
    attention = (q, q, cache, cache, table, lens, starts, 0.125)
    case("unified bf16 group2 d64", unified.unified_attention, *attention, None, 2048)
    case("decode bf16 group2 d64", decode_attention.decode_attention, *attention, None, 4)

    x, w = _meta(tokens, 4096), _meta(4096)
    case("rms_norm bf16 4096", norm.rms_norm, x, w, 1e-5)
    case("fused_add_rms_norm bf16 4096", norm.fused_add_rms_norm, x, _meta(tokens, 4096), w, 1e-5)
    case("rms_norm bf16 per-head 128", norm.rms_norm, _meta(tokens, 32, 128), _meta(128), 1e-6)
    cos = _meta(tokens, 64, dtype=torch.float32)
    case("rotary bf16 32x128", rotary.apply_rotary, _meta(tokens, 32, 128), cos, cos)
    case("silu_and_mul bf16 14336", activation.silu_and_mul, _meta(tokens, 14336), _meta(tokens, 14336))
    # Llama-3-8B's down projection in int4 (AWQ/GPTQ, groups of 128): decode (GEMV), a small
    # batch and a prefill chunk (tl.dot).
    k, n = 14336, 4096
    packed = (_meta(k // 8, n, dtype=torch.int32), _meta(k // 128, n), _meta(k // 128, n))
    for rows in (1, 16, 64, 512):
        case(f"int4_matmul bf16 M={rows}", int4_matmul.int4_matmul, _meta(rows, k), *packed, 128)
    case("int4 dequantize bf16", int4_matmul.dequantize, *packed, 128)
    # the GEMV's narrower tiles: q/k/v of Llama-3-8B (N=6144) and its gate/up (N=28672)
    for n_out in (6144, 28672):
        q = (_meta(4096 // 8, n_out, dtype=torch.int32), _meta(32, n_out), _meta(32, n_out))
        case(f"int4_matmul bf16 M=1 N={n_out}", int4_matmul.int4_matmul, _meta(1, 4096), *q, 128)
    # FP8 GEMM (row-wise scales) for decode batches: Llama-3-8B's o_proj and gate/up shapes.
    fp8 = torch.float8_e4m3fn
    for rows in (1, 16, 64):
        for n_out in (4096, 28672):
            case(
                f"fp8_gemm M={rows} N={n_out}",
                fp8_gemm.fp8_gemm,
                _meta(rows, 4096, dtype=fp8),
                _meta(n_out, 4096, dtype=fp8),
                _meta(rows, 1, dtype=torch.float32),
                _meta(1, n_out, dtype=torch.float32),
            )
    # FP8 activations, per token: a hidden-size row (one pass) and a longer one (two passes).
    for width in (4096, 28672):
        case(f"fp8 quantize_per_token bf16 {width}", fp8_quant.quantize_per_token, _meta(tokens, width))


def _signature(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict, dict, dict]:
    """Argument types, constexprs and attributes as Triton's launcher specializes them: integers
    divisible by 16 and (16-byte aligned) pointers are marked so, which is what lets the compiler
    prove loads contiguous and aligned and vectorize them; an integer equal to 1 becomes a constant."""
    bound = dict(zip(fn.arg_names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    divisible = [["tt.divisibility", 16]]
    for index, param in enumerate(fn.params):
        value = bound.get(param.name, param.default)
        if param.is_constexpr or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[param.name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TYPES[value.dtype]
            attrs[(index,)] = divisible
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = divisible
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {param.name}={value!r}")
    return signature, constexprs, attrs


def _ptxas_report(ptx: str, capability: int, arch: str) -> dict[str, int]:
    """Registers, spill bytes and shared memory from `ptxas -v` on the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(capability).path  # the one Triton itself uses for this architecture
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        result = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", str(path), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    report = result.stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, report)
        return int(found.group(1)) if found else 0

    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
        "shared": number(r"(\d+) bytes smem"),
    }


def main() -> None:
    _launch_all(sys.argv[1] if len(sys.argv) > 1 else "")
    rows: list[tuple[dict[str, Any], int]] = []  # (the case, its dynamic shared memory)
    ptxas_runs: list[tuple[str, int, str]] = []
    for name, fn, args, kwargs in _launches:
        signature, constexprs, attrs = _signature(fn, args, kwargs)
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        fp8 = any("fp8" in kind for kind in signature.values())
        for capability, arch in ARCHES:
            if fp8 and capability < 89:
                continue
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                target=GPUTarget("cuda", capability, 32),
                options=options,
            )
            row = {"case": name, "kernel": fn.__name__, "arch": arch, **options}
            rows.append((row, compiled.metadata.shared))
            ptxas_runs.append((compiled.asm["ptx"], capability, arch))
    # ptxas is most of the time, one process per kernel: as many at once as there are cores.
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        reports = pool.map(lambda run: _ptxas_report(*run), ptxas_runs)
        for (row, shared), report in zip(rows, reports, strict=True):
            # dynamic shared memory, which ptxas does not count
            print(json.dumps({**row, **report, "shared": shared}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
