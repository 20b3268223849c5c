"""What the attention kernel benchmarks share: backend setup, a scattered paged cache, torch baselines,
and GPU timing that neither the L2 cache nor Python launch overhead can flatter.

- `select_device` picks the device before `kvasir.kernels` is imported: CUDA for a real run; for
  `--smoke`, CPU with Triton's interpreter (`TRITON_INTERPRET=1`, read when a kernel is defined).
- `scattered_cache`: K/V blocks of every sequence at random places in the pool, as in a server
  that has been running for a while (not one contiguous run per sequence).
- `time_per_call_ms`: the calls are captured in one CUDA graph and replayed, so the figure is GPU
  time, as in the engine (which replays decode steps as CUDA graphs); each call reads its own
  copy of the data, and the copies together exceed the L2 cache several times over.
- `TorchAttention`: `F.scaled_dot_product_attention` with one backend and one way of handling GQA.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Smallest number of kernel calls one timed graph replay holds (the event overhead is then noise).
MIN_CALLS_PER_TIMING = 20
# The copies of the data that timed calls rotate over add up to at least this many L2 caches.
L2_MULTIPLE = 4
# Fraction of free device memory a shape may plan to use (the rest is the allocator's slack).
MEMORY_HEADROOM = 0.92


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Head layout (Llama-3-8B's by default), block size, timing, seed and `--smoke`."""
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-graph", action="store_true", help="time eager launches, not CUDA graph replays")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes on CPU through Triton's interpreter: checks the script end to end, measures nothing",
    )


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Smoke runs get a head layout small enough for the interpreter (2 KV heads, so a batch of 1
    still takes the split-K path); the layout is checked."""
    if args.smoke:
        args.num_q_heads, args.num_kv_heads, args.head_dim = 8, 2, 64
    if args.num_q_heads % args.num_kv_heads:
        parser.error("--num-q-heads must be a multiple of --num-kv-heads")
    return args


def select_device(smoke: bool) -> Any:
    """The torch device to benchmark on; sets up Triton's interpreter for a CPU smoke run.

    Must run before anything imports `kvasir.kernels.triton_ops`. `KVASIR_KERNELS=torch` in the
    environment is respected (the torch reference then runs instead of the kernels).
    """
    import torch

    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("KVASIR_KERNELS", "triton")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU (use --smoke for a tiny CPU run)")
    return torch.device("cuda")


def kernels_label(device: Any) -> str:
    """Which implementation `kvasir.kernels.paged_attention` runs on `device`, for the header."""
    from kvasir.kernels.dispatch import interpreter_enabled, use_triton

    if not use_triton(device):
        return "torch reference (KVASIR_KERNELS=torch or no Triton)"
    return "Triton (interpreter, CPU)" if interpreter_enabled() else "Triton"


def free_device_bytes(device: Any) -> int | None:
    """Free memory of a CUDA device after emptying torch's cache; None on CPU (not checked)."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info(device)[0])


def rotation_copies(bytes_per_copy: int, device: Any) -> int:
    """How many copies of the data the timed calls rotate over so that L2 cannot hold them."""
    import torch

    if device.type != "cuda":
        return 1
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return max(1, math.ceil(L2_MULTIPLE * l2_bytes / max(1, bytes_per_copy)))


@dataclass(frozen=True)
class ScatteredCache:
    """A paged K/V pool and, per copy, a block table whose blocks lie at random places in it."""

    k_cache: Any  # [num_blocks, block_size, Hkv, D]
    v_cache: Any
    block_tables: Any  # [copies, num_seqs, blocks_per_seq] int32; copies use disjoint blocks

    def gather(self, copy: int, context_len: int) -> tuple[Any, Any]:
        """This copy's K and V as contiguous [num_seqs, Hkv, context_len, D] tensors (SDPA's layout).

        Gathered a few sequences at a time, so the transient copy stays small next to the result.
        """
        import torch

        table = self.block_tables[copy].long()
        num_seqs = table.shape[0]
        _, _, num_kv_heads, head_dim = self.k_cache.shape
        shape = (num_seqs, num_kv_heads, context_len, head_dim)
        out_k = torch.empty(shape, dtype=self.k_cache.dtype, device=self.k_cache.device)
        out_v = torch.empty_like(out_k)
        chunk = max(1, (64 << 20) // max(1, context_len * num_kv_heads * head_dim))
        for first in range(0, num_seqs, chunk):
            rows = table[first : first + chunk]
            for cache, out in ((self.k_cache, out_k), (self.v_cache, out_v)):
                blocks = cache[rows].flatten(1, 2)[:, :context_len]  # [n, L, Hkv, D]
                out[first : first + chunk] = blocks.permute(0, 2, 1, 3)
        return out_k, out_v


def scattered_cache(
    copies: int,
    num_seqs: int,
    context_len: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: Any,
    device: Any,
    generator: Any,
) -> ScatteredCache:
    """Random K/V for `copies` x `num_seqs` sequences of `context_len` tokens in one shuffled pool."""
    import torch

    blocks_per_seq = -(-context_len // block_size)
    num_blocks = copies * num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    for cache in (k_cache, v_cache):
        cache.normal_(generator=generator)
    order = torch.randperm(num_blocks, generator=generator, device=device)
    tables = order.to(torch.int32).view(copies, num_seqs, blocks_per_seq).contiguous()
    return ScatteredCache(k_cache, v_cache, tables)


def paged_bytes(
    copies: int, num_seqs: int, context_len: int, num_kv_heads: int, head_dim: int, block_size: int
) -> int:
    """Bytes `scattered_cache` allocates in a 2-byte dtype."""
    blocks_per_seq = -(-context_len // block_size)
    return 2 * copies * num_seqs * blocks_per_seq * block_size * num_kv_heads * head_dim * 2


@dataclass(frozen=True)
class TorchAttention:
    """`F.scaled_dot_product_attention` restricted to one backend, with one way of handling GQA.

    gqa: `enable_gqa` (SDPA's flag), `expanded` (K/V heads repeated beforehand, outside the timing;
    costs the group size in memory and bytes read) or `folded` (decode only: a request's query
    heads sharing a KV head become query rows of that head, exact when the one query sees every key).
    """

    backend_name: str  # flash | efficient | cudnn
    gqa: str

    @property
    def name(self) -> str:
        return f"sdpa {self.backend_name}/{self.gqa}"

    def backend(self) -> Any:
        from torch.nn.attention import SDPBackend

        return {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
        }[self.backend_name]

    def bind(self, q: Any, k: Any, v: Any, causal: bool) -> Callable[[], Any]:
        """A call computing attention of q [B, Hq, Lq, D] over k/v [B, Hkv, Lk, D]; returns [B, Hq, Lq, D].

        Raises whatever SDPA raises when the backend cannot take these inputs (the caller skips it,
        printing the reason).
        """
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        batch, num_heads, num_queries, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        backend = self.backend()
        if self.gqa == "folded":
            if num_queries != 1 or causal:
                raise ValueError("folded GQA is exact only for one non-causal query row per request")
            q_rows = q.reshape(batch, num_kv_heads, group, head_dim)

            def call() -> Any:
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(q_rows, k, v)
                return out.reshape(batch, num_heads, 1, head_dim)  # flash may return it strided

        elif self.gqa == "expanded":
            k_all, v_all = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

            def call() -> Any:
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k_all, v_all, is_causal=causal)

        else:

            def call() -> Any:
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        with warnings.catch_warnings():  # SDPA warns at length about each backend it rejects
            warnings.simplefilter("ignore")
            call()  # fail here, before any timing or graph capture
        return call


def time_per_call_ms(calls: Sequence[Callable[[], Any]], device: Any, use_graph: bool) -> tuple[float, str]:
    """Median milliseconds of one call, the calls run in turn; and how it was timed.

    On CUDA the calls (repeated up to MIN_CALLS_PER_TIMING) are captured in one CUDA graph and
    replayed; if capture fails, or with `use_graph=False`, they are launched eagerly. On CPU it is
    wall-clock time (smoke runs).
    """
    from _gpu import cuda_time_ms

    if device.type != "cuda":
        cycle = itertools.cycle(calls)
        return cuda_time_ms(lambda: next(cycle)(), warmup=1, iters=3), "CPU wall clock"
    reps = max(1, math.ceil(MIN_CALLS_PER_TIMING / len(calls)))
    num_calls = reps * len(calls)

    def run_all() -> None:
        for _ in range(reps):
            for call in calls:
                call()

    if use_graph:
        graph = _capture(run_all)
        if graph is not None:
            return cuda_time_ms(graph.replay, warmup=2, iters=10) / num_calls, "CUDA graph"
    return cuda_time_ms(run_all, warmup=2, iters=10) / num_calls, "eager"


def _capture(fn: Callable[[], None]) -> Any:
    """`fn` captured as a CUDA graph (after a warm-up on a side stream), or None if it cannot be."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compiles Triton kernels and lets SDPA pick its kernels outside capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.cuda.graph(graph):
                fn()
    except RuntimeError as error:
        print(f"  (CUDA graph capture failed, timing eagerly: {str(error).splitlines()[0]})")
        torch.cuda.synchronize()
        return None
    return graph


def max_abs_diff(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max())


def timing_note(device: Any, no_graph: bool) -> str:
    """One line saying how `time_per_call_ms` timed the calls, for a benchmark's header."""
    if device.type != "cuda":
        return "CPU wall clock (smoke run: not a GPU figure)"
    launch = "eager launches" if no_graph else "CUDA-graph replays"
    return (
        f"median of {launch} of >= {MIN_CALLS_PER_TIMING} calls; the calls rotate over copies of the "
        f"data adding up to >= {L2_MULTIPLE}x the L2 cache, so no shape is served from L2"
    )


def first_line(error: BaseException, limit: int = 160) -> str:
    """An exception's first line, shortened: SDPA's refusals run to many lines of warnings."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."
