"""Kvasir kernels: each op as a plain-torch reference (and, on CUDA, a Triton kernel)."""
