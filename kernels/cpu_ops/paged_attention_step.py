"""One decode step's C paged attention for every layer: the step's metadata checked once.

A step's block table, lengths, slots and rotary angles are the same for every layer; the per-call
wrappers of `paged_attention` check and convert them again in each of the model's layers (about
half of a layer's attention time at batch 1). `PagedAttentionStep` checks their structure once,
keeps their C arguments, and each layer's call checks only its own tensors (q, k, v and its cache
must have the shapes the step was built for). The data checks stay in C, per call: a bad length
or block id still fails the first layer with a `ValueError` naming the request, a bad slot with
one naming the token.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from kvasir.kernels.checks import check_attention
from kvasir.kernels.cpu_ops.paged_attention import CACHE_DTYPES, PROBLEMS, library, supports


class PagedAttentionStep:
    """Rotary + KV store and paged attention of one step's `num_tokens` rows, for every layer whose
    q is [T, num_heads, D] float32 and whose cache has `k_cache`'s shape and dtype."""

    def __init__(
        self,
        q: Tensor,
        k_cache: Tensor,
        block_table: Tensor,
        seq_lens: Tensor,
        query_start_loc: Tensor,
        slot_mapping: Tensor,
    ) -> None:
        compiled = library()
        if compiled is None or not supports(q, k_cache):
            raise ValueError("the CPU paged-attention kernel does not take this step (see `supports`)")
        # The structural checks of the per-call wrappers, once (k and v take q's place: they share
        # the cache's shape; the caches of every layer are alike).
        check_attention(q, k_cache, k_cache, block_table, seq_lens, query_start_loc, None)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        key_shape = torch.Size((num_tokens, num_kv_heads, head_dim))
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
            raise ValueError(
                f"slot_mapping must be int64 of shape [{num_tokens}], "
                f"got {slot_mapping.dtype} of shape {list(slot_mapping.shape)}"
            )
        if not slot_mapping.is_contiguous() or slot_mapping.device.type != "cpu":
            raise ValueError("slot_mapping must be a contiguous CPU tensor")
        # Kept alive here: the C arguments below are their addresses.
        self._tensors = block_table.contiguous(), seq_lens, query_start_loc, slot_mapping
        block_table = self._tensors[0]
        self._rotary_c = compiled.rotary_store_kv
        self._attention_c = compiled.paged_attention
        self.q_shape = q.shape
        self.key_shape = key_shape
        self.cache_shape, self.cache_dtype = k_cache.shape, k_cache.dtype
        self.num_slots = k_cache.shape[0] * k_cache.shape[1]
        self._head_dim = head_dim
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None
        self._slots = slot_mapping.data_ptr()
        self._store_shape = (num_tokens, num_heads, num_kv_heads, head_dim)
        self._cache_code = CACHE_DTYPES[k_cache.dtype]
        # paged_attention's arguments from block_table to block_size, in the C signature's order.
        self._attention_args = (
            block_table.data_ptr(),
            block_table.shape[1],
            seq_lens.data_ptr(),
            query_start_loc.data_ptr(),
            block_table.shape[0],
            num_heads,
            num_kv_heads,
            head_dim,
            k_cache.shape[1],
        )
        self._threads = torch.get_num_threads()
        self._bad_request = ctypes.c_int64(-1)
        self._bad_request_ref = ctypes.byref(self._bad_request)

    def rotary_store_kv(
        self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor
    ) -> Tensor:
        """As `paged_attention.rotary_store_kv` with the step's slots; returns the rotated q."""
        self._check_layer(q, k, v, k_cache, v_cache)
        if cos is not self._cos or sin is not self._sin:  # the first layer (the model's angles are per step)
            self._bind_rotary(cos, sin)
        num_tokens, num_heads, num_kv_heads, head_dim = self._store_shape
        # empty_like: half the cost of empty(shape), and this runs in every layer.
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
        bad = self._rotary_c(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            self._cos_ptr, self._sin_ptr, self._slots, num_tokens, num_heads, num_kv_heads, head_dim,
            q_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), self.num_slots, self._cache_code,
        )  # fmt: skip
        if bad:
            raise ValueError(
                f"slot_mapping[{bad - 1}] is outside -1..{self.num_slots - 1} (the cache's slots)"
            )
        return q_out

    def attend(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float, sliding_window: int | None
    ) -> Tensor:
        """As `paged_attention.paged_attention` over the step's requests; q as `rotary_store_kv` returns it."""
        if q.shape != self.q_shape or not q.is_contiguous() or q.dtype != torch.float32:
            raise ValueError(
                f"q must be contiguous float32 {list(self.q_shape)}, got {q.dtype} {list(q.shape)}"
            )
        self.check_cache(k_cache, v_cache)
        out = torch.empty_like(q)  # q is contiguous
        problem = self._attention_c(
            q.data_ptr(), self.q_shape[0], k_cache.data_ptr(), v_cache.data_ptr(), self.cache_shape[0],
            self._cache_code, *self._attention_args, scale, sliding_window or 0, out.data_ptr(),
            self._threads, self._bad_request_ref,
        )  # fmt: skip
        if problem:
            raise ValueError(PROBLEMS[problem].format(r=self._bad_request.value))
        return out

    def stack_fields(self, cos: Tensor, sin: Tensor) -> dict[str, int | float]:
        """The step's metadata as `decoder_stack.c`'s `Step` fields of the same names (the angles
        checked as `rotary_store_kv` checks them)."""
        if cos is not self._cos or sin is not self._sin:
            self._bind_rotary(cos, sin)
        (
            block_table,
            stride,
            seq_lens,
            query_start,
            num_requests,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
        ) = self._attention_args
        return {
            "num_tokens": self.q_shape[0],
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "cache_dtype": self._cache_code,
            "threads": self._threads,
            "num_blocks": self.cache_shape[0],
            "block_size": block_size,
            "num_slots": self.num_slots,
            "block_table": block_table,
            "block_table_stride": stride,
            "seq_lens": seq_lens,
            "query_start": query_start,
            "num_requests": num_requests,
            "slots": self._slots,
            "cos": self._cos_ptr,
            "sin": self._sin_ptr,
        }

    def _bind_rotary(self, cos: Tensor, sin: Tensor) -> None:
        half = (self.q_shape[0], self._head_dim // 2)
        for name, tensor in (("cos", cos), ("sin", sin)):
            if (
                tensor.dtype != torch.float32
                or not tensor.is_contiguous()
                or tensor.numel() != half[0] * half[1]
            ):
                raise ValueError(
                    f"{name} must be contiguous float32 [{half[0]}, {half[1]}], got {list(tensor.shape)}"
                )
        self._cos, self._sin = cos, sin
        self._cos_ptr, self._sin_ptr = cos.data_ptr(), sin.data_ptr()

    def _check_layer(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
        head_strides = (self._head_dim, 1)  # heads contiguous within a row; rows may be strided
        for name, tensor, shape in (
            ("q", q, self.q_shape),
            ("k", k, self.key_shape),
            ("v", v, self.key_shape),
        ):
            if tensor.shape != shape or tensor.dtype != torch.float32 or tensor.stride()[1:] != head_strides:
                raise ValueError(
                    f"{name} must be float32 {list(shape)} with contiguous heads, "
                    f"got {tensor.dtype} {list(tensor.shape)} strides {tensor.stride()}"
                )
        self.check_cache(k_cache, v_cache)

    def check_cache(self, k_cache: Tensor, v_cache: Tensor) -> None:
        """Raise unless both caches have the shape and dtype of the step's first layer, contiguous."""
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (
                cache.shape != self.cache_shape
                or cache.dtype != self.cache_dtype
                or not cache.is_contiguous()
            ):
                raise ValueError(
                    f"{name} must be contiguous {self.cache_dtype} {list(self.cache_shape)} like the "
                    f"step's first layer, got {cache.dtype} {list(cache.shape)}"
                )
