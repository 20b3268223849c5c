"""The CPU launch wrapper of `group_affine_gemm.c` (weights in `group_affine_layout`'s tiles).

`TiledGemm(weight, activation_bits)` binds one tiled weight to the C kernel once (at load), so a
call costs one ctypes call: a decode step makes some 120 of them, and a per-call wrapper that looked
the library up and rebuilt its arguments cost about a fifth of the GEMMs' own time. Three
arithmetics (see the C file): x rounded to 8 or 16 bits per block of 32 (the twin is
`kvasir.kernels.reference.group_affine.group_affine_linear_int`) or float activations, 0 bits (the
twin is `group_affine_linear`, the dequantized weight's GEMM).

`TiledGemm.run_wide` is the C file's wide form: each group's term summed over the groups in float64
and returned as float64, so a sum split across tensor-parallel ranks (on group boundaries) and
added in float64 rounds to the bits of one process's whole sum (`RowParallelLinear`).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from kvasir.kernels.cpu_ops import Signatures, load_library
from kvasir.kernels.cpu_ops.group_affine_layout import TiledWeight

# Weights per thread below which a call runs on fewer threads: each parallel region ends in a
# barrier, and on a busy machine a thread that is descheduled stalls the others at it (with two
# threads on a shared 2-core machine, small GEMVs ran 10x slower than on one).
WEIGHTS_PER_THREAD = 1 << 18

# (bits, group) the C kernel takes (5: 8-bit codes that fit five bits, see group_affine_layout).
LAYOUTS = ((4, 32), (8, 32), (8, 16), (5, 32))
# Integer activations share one step per block of this many inputs.
ACTIVATION_BLOCK = 32
# 0: float32 activations; 8 or 16: rounded to that many bits per block.
ACTIVATION_BITS = (0, 8, 16)


class _Plan(ctypes.Structure):
    """The C file's `Plan`: one weight's fixed arguments."""

    _fields_ = (
        ("bits", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("act_bits", ctypes.c_int32),
        ("half", ctypes.c_int32),
        ("codes", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("offset", ctypes.c_void_p),
        ("N", ctypes.c_int64),
        ("K", ctypes.c_int64),
    )


_GEMM_ARGS = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
_PLANNED_ARGS = [ctypes.POINTER(_Plan), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
SIGNATURES: Signatures = {
    "group_affine_tiled_gemm": (ctypes.c_int, _GEMM_ARGS),
    "group_affine_tiled_gemm_portable": (ctypes.c_int, _GEMM_ARGS),
    "group_affine_tiled_gemm_avx2": (ctypes.c_int, _GEMM_ARGS),
    "group_affine_tiled_gemm_avx_vnni": (ctypes.c_int, _GEMM_ARGS),
    "group_affine_tiled_gemm_planned": (ctypes.c_int, _PLANNED_ARGS),
    "group_affine_tiled_gemm_wide": (
        ctypes.c_int,
        [ctypes.POINTER(_Plan), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int],
    ),
    "group_affine_kernel_isa": (ctypes.c_int, []),
    "group_affine_256_supported": (ctypes.c_int, []),
}

# `TiledGemm(kernel=...)`: "best" (what this CPU runs fastest), or a version on purpose (tests):
# "avx_vnni" and "avx2" (integer activations; float ones run the portable loops), "portable"
# (plain C loops).
KERNELS = ("best", "avx_vnni", "avx2", "portable")
# The C file's ISA_* number of each version (-1: the best this CPU runs).
_KERNEL_ISA_NUMBERS = {"best": -1, "avx_vnni": 3, "avx2": 1, "portable": 0}
# group_affine_kernel_isa() -> what integer-activation calls run here.
KERNEL_ISAS = {2: "AVX512-VNNI", 3: "AVX-VNNI", 1: "AVX2", 0: "portable loops"}


def library() -> ctypes.CDLL | None:
    """`group_affine_gemm.c` compiled (None where it cannot be; the torch reference runs then)."""
    return load_library("group_affine_gemm", SIGNATURES)


def kernel_isa() -> str:
    """What integer-activation calls run on this CPU (for the startup log); "" without the library."""
    compiled = library()
    return "" if compiled is None else KERNEL_ISAS[compiled.group_affine_kernel_isa()]


def runs_here(kernel: str) -> bool:
    """Whether `kernel` (one of `KERNELS`) runs on this CPU: the tests call the 256-bit versions on
    AVX-512 machines too, where the CPU has their instructions."""
    compiled = library()
    if compiled is None:
        return False
    supported = compiled.group_affine_256_supported()
    return {"avx2": bool(supported & 1), "avx_vnni": bool(supported & 2)}.get(kernel, True)


def takes_layout(bits: int, group: int) -> bool:
    return (bits, group) in LAYOUTS and library() is not None


class TiledGemm:
    """`x [.., K] @ W.T -> [.., N]` for one tiled weight and float32 CPU x of any number of rows
    (`accepts`); `kernel` picks a version of the C code other than the best (tests: `KERNELS`)."""

    def __init__(self, weight: TiledWeight, activation_bits: int, *, kernel: str = "best") -> None:
        compiled = library()
        if compiled is None:
            raise RuntimeError("the CPU group-affine kernel is not built here")
        if (weight.bits, weight.group) not in LAYOUTS or activation_bits not in ACTIVATION_BITS:
            raise ValueError(
                f"the CPU group-affine kernel takes {LAYOUTS} (bits, group) and activation bits "
                f"{ACTIVATION_BITS}, not ({weight.bits}, {weight.group}) with {activation_bits}"
            )
        if activation_bits and weight.in_features % ACTIVATION_BLOCK:
            raise ValueError(f"integer activations need in_features in blocks of {ACTIVATION_BLOCK}")
        self.weight = weight  # holds the tensors whose addresses the plan passes
        self._n, self._k = weight.out_features, weight.in_features
        self._most_threads = max(1, self._n * self._k // WEIGHTS_PER_THREAD)
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self._chosen = None if kernel == "best" else getattr(compiled, f"group_affine_tiled_gemm_{kernel}")
        self._planned = compiled.group_affine_tiled_gemm_planned
        self._wide = compiled.group_affine_tiled_gemm_wide
        self._isa = _KERNEL_ISA_NUMBERS[kernel]
        if weight.scale.dtype != weight.offset.dtype or weight.scale.dtype not in (
            torch.float16,
            torch.float32,
        ):
            raise ValueError(f"scales and offsets must both be float16 or float32, got {weight.scale.dtype}")
        half = int(weight.scale.dtype == torch.float16)
        self._plan = _Plan(weight.bits, weight.group, activation_bits, half, weight.codes.data_ptr(),
                           weight.scale.data_ptr(), weight.offset.data_ptr(), self._n, self._k)  # fmt: skip
        self._plan_ref = ctypes.byref(self._plan)

    @property
    def plan_address(self) -> int:
        """The address of this weight's C `Plan` (for a C caller such as `decoder_stack.c`; valid
        while this object lives)."""
        return ctypes.addressof(self._plan)

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return self._n, self._k

    def threads(self) -> int:
        """Threads a call runs on: torch's setting, fewer for a small weight (`WEIGHTS_PER_THREAD`)."""
        return min(torch.get_num_threads(), self._most_threads)

    def accepts(self, x: Tensor) -> bool:
        """float32 on the CPU, at least one row."""
        return x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() >= self._k

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self._k:
            raise ValueError(f"x has {x.shape[-1]} features, the weight takes {self._k}")
        if not self.accepts(x):
            raise ValueError("the CPU group-affine kernel does not take this call (see `accepts`)")
        return self.run(x)

    def run(self, x: Tensor) -> Tensor:
        """`__call__` without its checks, for a caller that has checked `accepts` (the hot path)."""
        flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self._k).contiguous()
        rows = flat.shape[0]
        out = torch.empty((rows, self._n), dtype=torch.float32)
        threads = self.threads()
        if self._chosen is None:
            status = self._planned(self._plan_ref, flat.data_ptr(), out.data_ptr(), rows, threads)
        else:
            p = self._plan
            status = self._chosen(p.bits, p.group, p.act_bits, p.half, flat.data_ptr(), p.codes, p.scale,
                                    p.offset, out.data_ptr(), rows, self._n, self._k, threads)  # fmt: skip
        _check(status)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self._n)

    def run_wide(self, x: Tensor) -> Tensor:
        """`run`'s product in float64, each group's float32 term summed over the groups in float64
        (for a caller that has checked `accepts`)."""
        flat = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self._k).contiguous()
        out = torch.empty((flat.shape[0], self._n), dtype=torch.float64)
        _check(
            self._wide(
                self._plan_ref, self._isa, flat.data_ptr(), out.data_ptr(), flat.shape[0], self.threads()
            )
        )
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self._n)


def _check(status: int) -> None:
    """Raise for a C call's nonzero status."""
    if status == -2:
        raise MemoryError("the CPU group-affine kernel could not allocate its activation buffers")
    if status == -3:
        raise RuntimeError("this CPU lacks the instructions of the kernel version asked for")
    if status != 0:
        raise ValueError(f"the CPU group-affine kernel refused this call (status {status})")


def supports(x: Tensor, weight: TiledWeight, activation_bits: int) -> bool:
    """Whether the C kernel runs this call: float32 on CPU, few enough rows, whole blocks of 32
    for integer activations, a layout it has."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and (weight.bits, weight.group) in LAYOUTS
        and rows > 0
        and activation_bits in ACTIVATION_BITS
        and (activation_bits == 0 or weight.in_features % ACTIVATION_BLOCK == 0)
    )


def tiled_linear(x: Tensor, weight: TiledWeight, activation_bits: int, *, kernel: str = "best") -> Tensor:
    """One call of `TiledGemm(weight, activation_bits)` (binds the weight each time: tests and
    benchmarks; layers keep a `TiledGemm`)."""
    if not supports(x, weight, activation_bits):
        if x.shape[-1] != weight.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight takes {weight.in_features}")
        raise ValueError("the CPU group-affine kernel does not take this call (see `supports`)")
    return TiledGemm(weight, activation_bits, kernel=kernel)(x)
