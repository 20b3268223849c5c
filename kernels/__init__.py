"""Kvasir kernels: each op as a plain-torch reference (and, on CUDA, a Triton kernel)."""

from kvasir.kernels.paged_attention import paged_attention, store_kv

__all__ = ["paged_attention", "store_kv"]
