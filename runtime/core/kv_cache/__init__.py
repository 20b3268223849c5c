"""Paged KV cache block accounting. Pure Python: never imports torch."""
