"""LoRA adapters in the CPU decoder stack (`decoder_stack.c`'s `LoRA`): the slot pool bound once,
and one step's adapter rows.

The pool is the one the layer-by-layer path reads (`kvasir.kernels.reference.lora`'s layout: per
projection, `a` [S, n*R, in] and `b` [S, n*R, out] with slice i's B^T in rows i*R.. and its own
columns), so there is one copy of the weights. The C code reads only the blocks that hold an
adapter: of each slot present in the step, the first `ranks[slot]` rows of each slice's A and of
B^T's own columns, never the zeros of the block-diagonal layout or of the rank padding. The pool
is float32 or bfloat16 (`--lora-dtype`); either way the C code computes in float32.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvasir.kernels.lora_rows import LoRARows

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32

PROJECTIONS = ("qkv", "o", "gate_up", "down")
# decoder_stack.c's `LoRA.weight_dtype` codes: the pool's element type.
WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class LoRAWeightsStruct(ctypes.Structure):
    """decoder_stack.c's `LoRAWeights`: one projection's `a` and `b` slot stacks."""

    _fields_ = (("a", _P), ("b", _P))


class LoRALayerStruct(ctypes.Structure):
    """decoder_stack.c's `LoRALayer`."""

    _fields_ = tuple((name, LoRAWeightsStruct) for name in PROJECTIONS)


class LoRAStruct(ctypes.Structure):
    """decoder_stack.c's `LoRA`: the bound pool and one step's rows."""

    _fields_ = (
        ("layers", _P),
        ("rank", _I64),
        ("scalings", _P),
        ("ranks", _P),
        ("num_groups", _I64),
        ("group_slots", _P),
        ("group_starts", _P),
        ("rows", _P),
        ("weight_dtype", _I32),
    )


@dataclass(frozen=True)
class LoRAPool:
    """The slot pool as the stack reads it: per layer, each projection's (a, b) stacks (`dtype`,
    float32 or bfloat16, contiguous, on the CPU), the pool's rank R, and per slot its scaling and
    its adapter's rank (rows of each slice beyond it hold zeros and are skipped)."""

    layers: tuple[Mapping[str, tuple[Tensor, Tensor]], ...]
    rank: int
    scalings: Tensor  # [S] float32
    ranks: Tensor  # [S] int32
    dtype: torch.dtype = torch.float32

    @property
    def num_slots(self) -> int:
        return self.scalings.shape[0]


class BoundLoRAPool:
    """A `LoRAPool` checked against a stack's projection shapes and laid out as C structs."""

    def __init__(self, pool: LoRAPool, shapes: Mapping[str, tuple[int, tuple[int, ...]]]) -> None:
        """`shapes`: projection name -> (input size, output slice sizes)."""
        slots, rank = pool.num_slots, pool.rank
        if rank < 1:
            raise ValueError(f"the LoRA pool's rank must be positive, got {rank}")
        _check_weight_dtype(pool.dtype)
        for name, tensor, dtype in (
            ("scalings", pool.scalings, torch.float32),
            ("ranks", pool.ranks, torch.int32),
        ):
            if tensor.shape != (slots,) or tensor.dtype != dtype or not tensor.is_contiguous():
                raise ValueError(
                    f"LoRA {name} must be a contiguous {dtype} [{slots}], got {tensor.dtype} {list(tensor.shape)}"
                )
            _check_cpu(f"LoRA {name}", tensor)
        self.pool = pool
        self.layers = (LoRALayerStruct * len(pool.layers))()
        for index, (c_layer, weights) in enumerate(zip(self.layers, pool.layers, strict=True)):
            for name in PROJECTIONS:
                n_in, slices = shapes[name]
                a, b = weights[name]
                width = len(slices) * rank
                for what, tensor, shape in (
                    ("a", a, (slots, width, n_in)),
                    ("b", b, (slots, width, sum(slices))),
                ):
                    if tensor.shape != shape or tensor.dtype != pool.dtype or not tensor.is_contiguous():
                        raise ValueError(
                            f"layer {index}: LoRA {name}.{what} must be a contiguous {_name(pool.dtype)} "
                            f"{list(shape)}, got {tensor.dtype} {list(tensor.shape)}"
                        )
                    _check_cpu(f"layer {index}: LoRA {name}.{what}", tensor)
                setattr(c_layer, name, LoRAWeightsStruct(a.data_ptr(), b.data_ptr()))

    def step(self, rows: LoRARows, num_tokens: int, num_layers: int) -> LoRAStruct:
        """The C `LoRA` of one step's rows (checked: one slot per token, slots in the pool)."""
        if num_layers > len(self.pool.layers):
            raise ValueError(f"the LoRA pool has {len(self.pool.layers)} layers, the step runs {num_layers}")
        return step_struct(self.pool, ctypes.addressof(self.layers), rows, num_tokens)


def step_struct(pool: LoRAPool, layers_address: int, rows: LoRARows, num_tokens: int) -> LoRAStruct:
    """The C `LoRA` for `rows` over `pool` (its layers' structs at `layers_address`)."""
    _check_weight_dtype(pool.dtype)
    if tuple(rows.token_slots.shape) != (num_tokens,):
        raise ValueError(f"the LoRA rows map {rows.token_slots.shape[0]} tokens, the step has {num_tokens}")
    for group in rows.groups:
        if not 0 <= group.slot < pool.num_slots:
            raise ValueError(f"LoRA slot {group.slot} is outside the pool's 0..{pool.num_slots - 1}")
    for name, tensor, dtype in (
        ("seg_slots", rows.seg_slots, torch.int32),
        ("seg_starts", rows.seg_starts, torch.int32),
        ("sorted_rows", rows.sorted_rows, torch.int64),
    ):
        if tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(f"LoRA rows' {name} must be contiguous {dtype}, got {tensor.dtype}")
        _check_cpu(f"LoRA rows' {name}", tensor)
    return LoRAStruct(
        layers_address,
        pool.rank,
        pool.scalings.data_ptr(),
        pool.ranks.data_ptr(),
        len(rows.groups),
        rows.seg_slots.data_ptr(),
        rows.seg_starts.data_ptr(),
        rows.sorted_rows.data_ptr(),
        WEIGHT_DTYPES[pool.dtype],
    )


def slice_shapes(
    hidden: int, intermediate: int, q_width: int, kv_width: int
) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each projection's (input size, output slices) in a Llama-family layer."""
    return {
        "qkv": (hidden, (q_width, kv_width, kv_width)),
        "o": (q_width, (hidden,)),
        "gate_up": (hidden, (intermediate, intermediate)),
        "down": (intermediate, (hidden,)),
    }


def _check_cpu(name: str, tensor: Tensor) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {tensor.device}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_weight_dtype(dtype: torch.dtype) -> None:
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"the C stack reads a float32 or bfloat16 LoRA pool, got {dtype}")


def check_projection_args(
    x: Tensor, a: Tensor, b: Tensor, out: Tensor, slices: Sequence[int], pool: LoRAPool
) -> None:
    """`lora_projection`'s tensors: x [T, in] and out [T, out] float32, a [S, n*R, in] and
    b [S, n*R, out] in the pool's dtype (all contiguous, on the CPU)."""
    width = len(slices) * pool.rank
    expected = {
        "x": (x, (out.shape[0], a.shape[-1]), torch.float32),
        "a": (a, (pool.num_slots, width, x.shape[-1]), pool.dtype),
        "b": (b, (pool.num_slots, width, sum(slices)), pool.dtype),
        "out": (out, (x.shape[0], sum(slices)), torch.float32),
    }
    for name, (tensor, shape, dtype) in expected.items():
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {_name(dtype)} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}"
            )
        _check_cpu(name, tensor)
