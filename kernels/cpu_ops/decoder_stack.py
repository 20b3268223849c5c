"""The CPU launch wrapper of `decoder_stack.c`: every decoder layer of a step in one C call.

`DecoderStack` binds a Llama-family model's packed GEMMs (`TiledGemm`), their biases, norm weights
(q/k norms included) and sliding windows once; `run` takes one step's embedded tokens, its `PagedAttentionStep` (the attention
metadata, checked once per step), the rotary angles and the KV caches, and returns the final
norm's output. The arithmetic is that of the per-layer path (the same C functions, in the same
order), except SiLU-and-multiply, which the C file computes with its own vector exponential: the
two paths agree to float32 rounding (tested), not bit for bit.

The o and down GEMMs sum in float64 (the packed GEMM's wide form) into a buffer of the step and
round once. Under tensor parallelism the stack runs this rank's shard of every layer and is given
`all_reduce`: C calls back into it after each of those two GEMMs, to sum that buffer over the ranks
in float64, so the all-reduces sit where the row-parallel layers put them (two a layer).

A step with LoRA adapter rows passes `lora` (the pool, bound at its first step, and the step's
`LoRARows`; see `decoder_stack_lora`): the adapters' terms are added in the C call. Without it the
C stack gets NULL and runs exactly its base code.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvasir.kernels.cpu_ops import Signatures, load_library
from kvasir.kernels.cpu_ops.decoder_stack_lora import (
    BoundLoRAPool,
    LoRAPool,
    LoRAStruct,
    LoRAWeightsStruct,
    check_projection_args,
    slice_shapes,
    step_struct,
)
from kvasir.kernels.cpu_ops.group_affine import TiledGemm
from kvasir.kernels.cpu_ops.paged_attention import PROBLEMS
from kvasir.kernels.cpu_ops.paged_attention_step import PagedAttentionStep
from kvasir.kernels.lora_rows import LoRARows

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _Layer(ctypes.Structure):
    """decoder_stack.c's `Layer`."""

    _fields_ = (
        *((name, _P) for name in PROJECTIONS),
        *((f"{name}_threads", _I32) for name in PROJECTIONS),
        *((f"{name}_bias", _P) for name in PROJECTIONS),
        *((name, _P) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "k_cache", "v_cache")),
        ("window", _I64),
    )


class _Step(ctypes.Structure):
    """decoder_stack.c's `Step`."""

    _fields_ = (
        *((name, _I64) for name in ("num_tokens", "hidden", "intermediate", "num_heads", "num_kv_heads")),
        ("head_dim", _I64),
        ("eps", _F),
        ("scale", _F),
        ("cache_dtype", _I32),
        ("threads", _I32),
        *((name, _I64) for name in ("num_blocks", "block_size", "num_slots")),
        ("block_table", _P),
        ("block_table_stride", _I64),
        ("seq_lens", _P),
        ("query_start", _P),
        ("num_requests", _I64),
        *((name, _P) for name in ("slots", "cos", "sin")),
        ("partial", _P),
        ("reduce", ctypes.CFUNCTYPE(ctypes.c_int)),
    )


SIGNATURES: Signatures = {
    "decoder_stack": (
        ctypes.c_int,
        [
            ctypes.POINTER(_Layer),
            _I64,
            ctypes.POINTER(_Step),
            _P,
            ctypes.POINTER(LoRAStruct),
            _P,
            ctypes.POINTER(ctypes.c_int64),
        ],
    ),
    "lora_projection": (
        ctypes.c_int,
        [ctypes.POINTER(LoRAStruct), ctypes.POINTER(LoRAWeightsStruct), _P, _I64, _P, _I64, _P, _I64],
    ),
}

# decoder_stack.c's own return codes (beyond paged_attention's PROBLEMS).
_BAD_SLOT, _GEMM_REFUSED, _NO_MEMORY, _REDUCE_FAILED = 16, 17, 18, 19
_Reduce = ctypes.CFUNCTYPE(ctypes.c_int)


def library() -> ctypes.CDLL | None:
    """`decoder_stack.c` compiled (None where it cannot be; the layers run one call at a time then)."""
    return load_library("decoder_stack", SIGNATURES)


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer as the C stack runs it: merged q/k/v and gate/up projections, o and down
    (each with its bias in `biases`, or none), the two RMSNorm weights (float32 [hidden]), the
    per-head q and k norms (float32 [head_dim], both or neither) and the layer's sliding window
    (None: full attention)."""

    qkv: TiledGemm
    o: TiledGemm
    gate_up: TiledGemm
    down: TiledGemm
    input_norm: Tensor
    post_norm: Tensor
    sliding_window: int | None
    biases: dict[str, Tensor] = field(default_factory=dict)  # projection name -> bias
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None


class DecoderStack:
    """The decoder layers of one model, bound to the C stack (see the module docstring);
    `all_reduce` sums a float64 tensor over the tensor-parallel ranks in place (None: one rank)."""

    def __init__(
        self,
        layers: Sequence[StackLayer],
        final_norm: Tensor,
        *,
        eps: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        all_reduce: Callable[[Tensor], object] | None = None,
    ) -> None:
        compiled = library()
        if compiled is None:
            raise RuntimeError("the CPU decoder-stack kernel is not built here")
        if not layers:
            raise ValueError("a decoder stack needs at least one layer")
        hidden = final_norm.shape[0]
        intermediate = layers[0].down.shape[1]
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        expected = {
            "qkv": (q_width + 2 * kv_width, hidden),
            "o": (hidden, q_width),
            "gate_up": (2 * intermediate, hidden),
            "down": (hidden, intermediate),
        }
        for index, layer in enumerate(layers):
            for name, shape in expected.items():
                if getattr(layer, name).shape != shape:
                    raise ValueError(
                        f"layer {index}: {name} is {getattr(layer, name).shape} (out, in), expected {shape}"
                    )
            for name, bias in layer.biases.items():
                if name not in expected:
                    raise ValueError(f"layer {index}: a bias for {name!r}, which is not one of {PROJECTIONS}")
                _check_vector(f"layer {index}: {name} bias", bias, expected[name][0])
            for name in ("input_norm", "post_norm"):
                _check_vector(f"layer {index}: {name}", getattr(layer, name), hidden)
            if (layer.q_norm is None) != (layer.k_norm is None):
                raise ValueError(f"layer {index}: q_norm and k_norm come together")
            for name in ("q_norm", "k_norm"):
                if getattr(layer, name) is not None:
                    _check_vector(f"layer {index}: {name}", getattr(layer, name), head_dim)
            if layer.sliding_window is not None and layer.sliding_window < 1:
                raise ValueError(
                    f"layer {index}: sliding_window must be positive, got {layer.sliding_window}"
                )
        _check_vector("final_norm", final_norm, hidden)
        self._run_c = compiled.decoder_stack
        self._layers = tuple(layers)  # hold the GEMMs and norm weights whose addresses the C structs keep
        self._final_norm = final_norm
        self._c_layers = (_Layer * len(layers))()
        for c_layer, layer in zip(self._c_layers, layers, strict=True):
            for name in PROJECTIONS:
                setattr(c_layer, name, getattr(layer, name).plan_address)
                found = layer.biases.get(name)
                setattr(c_layer, f"{name}_bias", None if found is None else found.data_ptr())
            for name in ("input_norm", "post_norm", "q_norm", "k_norm"):
                weight = getattr(layer, name)
                setattr(c_layer, name, None if weight is None else weight.data_ptr())
            c_layer.window = layer.sliding_window or 0
        self._bound_caches: tuple[int, ...] = ()
        self._bound_threads = -1
        self._shape = {
            "hidden": hidden,
            "intermediate": intermediate,
            "eps": eps,
            "scale": scale,
        }
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.hidden_size = hidden
        self._lora_shapes = slice_shapes(hidden, intermediate, q_width, kv_width)
        self._lora_pool: BoundLoRAPool | None = None
        self._bad = ctypes.c_int64(-1)
        self._bad_ref = ctypes.byref(self._bad)
        # The o and down GEMMs' float64 sums of the running step, and the callback C makes to
        # all-reduce them (None with one rank); what the all-reduce raised, for `run` to raise.
        self._partial = torch.empty(0, dtype=torch.float64)
        self._all_reduce = all_reduce
        self._c_reduce = None if all_reduce is None else _Reduce(self._reduce)
        self._reduce_error: BaseException | None = None

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def run(
        self,
        hidden: Tensor,
        step: PagedAttentionStep,
        cos: Tensor,
        sin: Tensor,
        kv_caches: Sequence[tuple[Tensor, Tensor]],
        lora: tuple[LoRAPool, LoRARows] | None = None,
    ) -> Tensor:
        """The first `len(kv_caches)` layers and the final norm over `hidden` [T, hidden] (the
        embedded tokens, float32, contiguous; overwritten with the result, which is returned), with
        the LoRA terms of `lora`'s adapter rows (None: the base code alone)."""
        num_tokens = step.q_shape[0]
        if (
            hidden.shape != (num_tokens, self.hidden_size)
            or hidden.dtype != torch.float32
            or not hidden.is_contiguous()
        ):
            raise ValueError(
                f"hidden must be contiguous float32 [{num_tokens}, {self.hidden_size}], "
                f"got {hidden.dtype} {list(hidden.shape)}"
            )
        if step.q_shape[1:] != (self.num_heads, self.head_dim):
            raise ValueError(
                f"the step is for q of {list(step.q_shape)}, the stack for {self.num_heads} heads"
            )
        num_layers = len(kv_caches)
        if not 0 < num_layers <= self.num_layers:
            raise ValueError(f"got {num_layers} KV caches for a stack of {self.num_layers} layers")
        self._bind_caches(step, kv_caches)
        self._partial = torch.empty((num_tokens, self.hidden_size), dtype=torch.float64)
        c_step = _Step(**self._shape, **step.stack_fields(cos, sin), partial=self._partial.data_ptr())
        if self._c_reduce is not None:  # (left NULL with one rank)
            c_step.reduce = self._c_reduce
        c_lora = (
            None
            if lora is None
            else ctypes.byref(self._bind_lora(lora[0]).step(lora[1], num_tokens, num_layers))
        )
        problem = self._run_c(
            self._c_layers, num_layers, ctypes.byref(c_step), self._final_norm.data_ptr(), c_lora,
            hidden.data_ptr(), self._bad_ref,
        )  # fmt: skip
        if problem == _REDUCE_FAILED:
            error, self._reduce_error = self._reduce_error, None
            raise RuntimeError(f"the all-reduce after layer {self._bad.value}'s GEMM failed") from error
        if problem:
            raise _error(problem, self._bad.value, step.num_slots)
        return hidden

    def _reduce(self) -> int:
        """C's callback: the running step's float64 sums all-reduced in place; 0, or 1 and the
        error kept (an exception must not cross into C)."""
        assert self._all_reduce is not None
        try:
            self._all_reduce(self._partial)
        except BaseException as error:  # kept, and re-raised by `run`
            self._reduce_error = error
            return 1
        return 0

    def _bind_lora(self, pool: LoRAPool) -> BoundLoRAPool:
        """The pool checked and laid out for C at its first step (the pool's tensors live as long as
        the engine; a new pool object is bound anew)."""
        if self._lora_pool is None or self._lora_pool.pool is not pool:
            self._lora_pool = BoundLoRAPool(pool, self._lora_shapes)
        return self._lora_pool

    def _bind_caches(self, step: PagedAttentionStep, kv_caches: Sequence[tuple[Tensor, Tensor]]) -> None:
        """Point each layer at its caches (checked against the step) when they or the thread count
        changed since the last step; one address comparison per cache otherwise."""
        addresses = tuple(cache.data_ptr() for pair in kv_caches for cache in pair)
        threads = torch.get_num_threads()
        if addresses == self._bound_caches[: len(addresses)] and threads == self._bound_threads:
            for k_cache, v_cache in kv_caches[:1]:  # the caches are alike: their shape is the step's
                step.check_cache(k_cache, v_cache)
            return
        for c_layer, layer, (k_cache, v_cache) in zip(self._c_layers, self._layers, kv_caches, strict=False):
            step.check_cache(k_cache, v_cache)
            c_layer.k_cache, c_layer.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            for name in PROJECTIONS:
                setattr(c_layer, f"{name}_threads", getattr(layer, name).threads())
        self._bound_caches, self._bound_threads = addresses, threads


def lora_projection(
    out: Tensor, x: Tensor, a: Tensor, b: Tensor, slices: Sequence[int], pool: LoRAPool, rows: LoRARows
) -> None:
    """Add one projection's LoRA terms into `out` [T, sum(slices)] in place, as the stack does after
    its GEMM: x [T, in], a [S, n*R, in] and b [S, n*R, out] in `pool`'s rank, slot count and dtype
    (for the tests; the stack calls the same C function)."""
    compiled = library()
    if compiled is None:
        raise RuntimeError("the CPU decoder-stack kernel is not built here")
    check_projection_args(x, a, b, out, slices, pool)
    c_lora = step_struct(pool, 0, rows, x.shape[0])
    c_slices = (ctypes.c_int64 * len(slices))(*slices)
    weights = LoRAWeightsStruct(a.data_ptr(), b.data_ptr())
    status = compiled.lora_projection(
        ctypes.byref(c_lora), ctypes.byref(weights), x.data_ptr(), x.shape[1], out.data_ptr(), out.shape[1],
        c_slices, len(slices),
    )  # fmt: skip
    if status:
        raise _error(status, 0, 0)


def _check_vector(name: str, weight: Tensor, size: int) -> None:
    if weight.shape != (size,) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous float32 [{size}], got {weight.dtype} {list(weight.shape)}"
        )
    if weight.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {weight.device}")


def _error(problem: int, bad: int, num_slots: int) -> Exception:
    if problem == _BAD_SLOT:
        return ValueError(f"slot_mapping[{bad}] is outside -1..{num_slots - 1} (the cache's slots)")
    if problem == _GEMM_REFUSED:
        return ValueError(f"the CPU group-affine kernel refused layer {bad}'s call")
    if problem == _NO_MEMORY:
        return MemoryError("the CPU decoder stack could not allocate its buffers")
    return ValueError(PROBLEMS[problem].format(r=bad))
