"""KV-cache sizing arithmetic: how many blocks a byte budget buys. No torch here.

The model runner measures the budget (a byte count on CPU, a fraction of free device memory on
CUDA) and calls these; `ModelConfig.kv_elements_per_token` supplies the per-token size.
"""

from __future__ import annotations

import os


def bytes_per_block(kv_elements_per_token: int, dtype_size: int, block_size: int) -> int:
    """Bytes one block takes across all layers, K and V (elements per token × element size × tokens)."""
    for name, value in (
        ("kv_elements_per_token", kv_elements_per_token),
        ("dtype_size", dtype_size),
        ("block_size", block_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return kv_elements_per_token * dtype_size * block_size


def num_blocks_for_budget(
    kv_elements_per_token: int, dtype_size: int, block_size: int, byte_budget: int
) -> int:
    """The number of whole blocks `byte_budget` holds; ValueError if not even one fits."""
    block_bytes = bytes_per_block(kv_elements_per_token, dtype_size, block_size)
    num_blocks = max(byte_budget, 0) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"a KV-cache budget of {byte_budget} bytes holds no block of {block_bytes} bytes "
            f"({block_size} tokens); raise --kv-cache-bytes / --kv-cache-memory-fraction"
        )
    return num_blocks


def num_blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (e.g. one sequence of max_model_len)."""
    return -(-num_tokens // block_size)


def machine_memory_bytes() -> int | None:
    """This machine's physical memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def format_bytes(count: int) -> str:
    return f"{count / (1 << 30):.1f} GiB" if count >= 1 << 30 else f"{count / (1 << 20):.1f} MiB"


def check_fits(
    num_blocks: int, block_bytes: int, memory_bytes: int | None, memory: str, setting: str
) -> None:
    """ValueError naming `setting` (what chose the size) when `num_blocks` blocks need more than
    `memory_bytes` (`memory` says whose), checked before anything is allocated."""
    need = num_blocks * block_bytes
    if memory_bytes is not None and need > memory_bytes:
        raise ValueError(
            f"{setting}: a KV cache of {num_blocks} blocks needs {format_bytes(need)}, more than "
            f"{memory} ({format_bytes(memory_bytes)}); lower it"
        )


def lora_pool_bytes(
    projections: list[tuple[int, int, int]], num_layers: int, max_loras: int, max_rank: int, dtype_size: int
) -> int:
    """Bytes of the LoRA slot pool (`--enable-lora`). Per slot, layer and projection of `slices`
    merged parts, `in` and `out` features: an A of slices*max_rank x in and a B of
    slices*max_rank x out (block-diagonal over the slices). It is allocated before the KV cache
    and taken out of the memory the cache may use."""
    per_layer = sum(slices * max_rank * (n_in + n_out) for slices, n_in, n_out in projections)
    return per_layer * num_layers * max_loras * dtype_size
