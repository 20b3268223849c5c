"""The CPU launch wrappers of `paged_attention.c`: store rotated K/V, attend over the paged cache.

See `kvasir.kernels.reference.attention` and `kvasir.kernels.reference.rotary` for the contract.
The C code reads the cache through the block table in place (the reference gathers every
request's blocks into a dense copy per layer), and converts a float16 or bfloat16 cache to float32
as it reads. Queries and outputs are float32; an fp8 cache is left to the reference.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from kvasir.kernels.checks import check_attention, check_store_kv
from kvasir.kernels.cpu_ops import Signatures, load_library

# Cache dtype -> its code in paged_attention.c.
CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
SIGNATURES: Signatures = {
    "paged_attention": (
        ctypes.c_int,
        [
            *(_P, _I64, _P, _P, _I64, ctypes.c_int, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64),
            *(ctypes.c_float, _I64, _P, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)),
        ],
    ),
    "rotary_store_kv": (
        ctypes.c_int,
        [_P, _I64, _P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, ctypes.c_int],
    ),
    "paged_attention_max_head_dim": (ctypes.c_int, []),
    "paged_attention_max_group": (ctypes.c_int, []),
}

# paged_attention's return codes (paged_attention.c) -> what was wrong with request r.
PROBLEMS = {
    1: "query_start_loc must run from 0 to num_tokens",
    2: "request {r}: its query length must be between 0 and its seq_len",
    3: "request {r}: its seq_len exceeds the block table's capacity",
    4: "request {r}: block_table holds a block id outside the cache",
}


def library() -> ctypes.CDLL | None:
    """`paged_attention.c` compiled (None where it cannot be; the torch reference runs then)."""
    return load_library("paged_attention", SIGNATURES)


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the C kernels take a layer: float32 queries on CPU, a float32/float16/bfloat16
    cache, a head size and query heads per KV head within the compiled limits."""
    if q.device.type != "cpu" or q.dim() != 3 or k_cache.dim() != 4:
        return False
    return takes(q.dtype, k_cache.dtype, q.shape[1], k_cache.shape[2], k_cache.shape[3])


def takes(
    query_dtype: torch.dtype, cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether the C kernels run a model of these attention shapes on CPU (decided once, at start)."""
    limits = _limits()
    return (
        limits is not None
        and query_dtype == torch.float32
        and cache_dtype in CACHE_DTYPES
        and head_dim % 2 == 0
        and head_dim <= limits[0]
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= limits[1]
    )


@functools.cache
def _limits() -> tuple[int, int] | None:
    """The compiled kernel's largest head_dim and query heads per KV head; None if not built."""
    compiled = library()
    if compiled is None:
        return None
    return compiled.paged_attention_max_head_dim(), compiled.paged_attention_max_group()


def rotary_store_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> Tensor:
    """Rotate q and k [T, H, D] by cos/sin ([T, D/2] or [T, 1, D/2]), store the rotated k and v
    at `slot_mapping` (slot -1 skipped); returns the rotated q as a new contiguous tensor."""
    compiled = _require(q, k_cache)
    check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    if head_dim != k_cache.shape[3] or k.shape[0] != num_tokens:
        raise ValueError(
            f"q {list(q.shape)} must have k's {k.shape[0]} tokens and the cache's head_dim {k_cache.shape[3]}"
        )
    cos, sin = cos.reshape(num_tokens, head_dim // 2), sin.reshape(num_tokens, head_dim // 2)
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dtype != torch.float32 or tensor.stride(2) != 1 or tensor.stride(1) != head_dim:
            raise ValueError(
                f"{name} must be float32 with contiguous heads, got {tensor.dtype} {tensor.stride()}"
            )
    for name, tensor in (("cos", cos), ("sin", sin)):
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [{num_tokens}, {head_dim // 2}]")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    bad = compiled.rotary_store_kv(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        slot_mapping.data_ptr(),
        num_tokens,
        num_heads,
        k_cache.shape[2],
        head_dim,
        q_out.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        num_slots,
        CACHE_DTYPES[k_cache.dtype],
    )
    if bad:
        raise ValueError(f"slot_mapping[{bad - 1}] is outside -1..{num_slots - 1} (the cache's slots)")
    return q_out


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """Causal attention of the flattened batch q [T, Hq, D] over the paged cache; returns [T, Hq, D]."""
    compiled = _require(q, k_cache)
    check_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, sliding_window)
    q, block_table = q.contiguous(), block_table.contiguous()  # no copies for the model's tensors
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)  # q is contiguous here
    bad_request = ctypes.c_int64(-1)
    problem = compiled.paged_attention(
        q.data_ptr(),
        num_tokens,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[0],
        CACHE_DTYPES[k_cache.dtype],
        block_table.data_ptr(),
        block_table.shape[1],
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
        block_table.shape[0],
        num_heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        scale,
        sliding_window or 0,
        out.data_ptr(),
        torch.get_num_threads(),
        ctypes.byref(bad_request),
    )
    if problem:
        raise ValueError(PROBLEMS[problem].format(r=bad_request.value))
    return out


def _require(q: Tensor, k_cache: Tensor) -> ctypes.CDLL:
    compiled = library()
    if compiled is None or not supports(q, k_cache):
        raise ValueError("the CPU paged-attention kernel does not take this call (see `supports`)")
    return compiled
