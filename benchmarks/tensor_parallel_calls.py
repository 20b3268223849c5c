"""What tensor parallelism's rank processes cost on CPU: a decode step at TP=1 and TP=2, and how
much of the TP=2 step rank 0 spends announcing the call and inside the all-reduces.

A random-weight Llama (TinyLlamaSpec: 8 layers, hidden 512, 8 heads, 2 KV heads) is written once;
for each size the real engine decodes `--batch` requests (16-token prompts, ignore_eos) and each
decode step after the prompts is timed around `LLMEngine.step()`. At TP=2, rank 0's
`CallChannel.send` (the one announcement per call: pickling plus one gloo broadcast) and
`all_reduce` (waiting for the other rank included, so an upper bound on the collective itself) are
timed by wrapping the class's methods in rank 0 only; the bytes are the pickled call. The threads:
TP=1 uses every CPU, each of the two ranks half of them. Medians over the measured steps.

    python benchmarks/tensor_parallel_calls.py --batch 1 32
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import TinyLlamaSpec, build_random_llama, print_header, print_table

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.parallel.call_channel import CallChannel
from kvasir.runtime.parallel.group import TensorParallel
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.threads import apply_threads


class _Timed:
    """Seconds and bytes recorded by the wrapped collectives, cleared per step."""

    def __init__(self) -> None:
        self.broadcast_s = 0.0
        self.broadcast_bytes = 0
        self.all_reduce_s = 0.0

    def wrap(self) -> Callable[[], None]:
        send, all_reduce = CallChannel.send, TensorParallel.all_reduce

        def timed_send(channel: CallChannel, obj: Any) -> None:
            began = time.perf_counter()
            send(channel, obj)
            self.broadcast_s += time.perf_counter() - began
            self.broadcast_bytes += len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

        def timed_all_reduce(parallel: TensorParallel, tensor: torch.Tensor) -> torch.Tensor:
            began = time.perf_counter()
            result = all_reduce(parallel, tensor)
            self.all_reduce_s += time.perf_counter() - began
            return result

        CallChannel.send = timed_send  # type: ignore[method-assign, assignment]
        TensorParallel.all_reduce = timed_all_reduce  # type: ignore[method-assign, assignment]

        def restore() -> None:
            CallChannel.send = send  # type: ignore[method-assign]
            TensorParallel.all_reduce = all_reduce  # type: ignore[method-assign]

        return restore


def measure(folder: Path, size: int, batch: int, steps: int) -> dict[str, float]:
    engine = LLMEngine(
        EngineConfig(
            model=str(folder), device="cpu", max_model_len=512, num_kv_blocks=2048, tensor_parallel_size=size
        )
    )
    timed = _Timed()
    restore = timed.wrap()
    try:
        params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
        for index in range(batch):
            engine.add_request(
                f"r{index}", prompt_token_ids=[3 + (index + t) % 500 for t in range(16)], params=params
            )
        engine.step()  # the prompts
        step_s, broadcast_s, broadcast_bytes, all_reduce_s = [], [], [], []
        for _ in range(steps):
            timed.__init__()  # type: ignore[misc]
            began = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - began)
            broadcast_s.append(timed.broadcast_s)
            broadcast_bytes.append(timed.broadcast_bytes)
            all_reduce_s.append(timed.all_reduce_s)
    finally:
        restore()
        engine.close()
    return {
        "step_ms": statistics.median(step_s) * 1e3,
        "broadcast_us": statistics.median(broadcast_s) * 1e6,
        "broadcast_bytes": statistics.median(broadcast_bytes),
        "all_reduce_ms": statistics.median(all_reduce_s) * 1e3,
    }


def _announce_rank(rank: int, port: int, calls: int, results: Any, store: Any = None) -> None:
    """One of two processes; rank 0 times a decode step's call (about 200 bytes) sent both ways:
    torch's broadcast_object_list (size, then bytes) and the engine's CallChannel (one broadcast)."""
    import torch.distributed as dist

    from kvasir.runtime.parallel.init import join_group

    parallel = join_group(rank, 2, port, "cpu", 60, store=store)
    channel, call = CallChannel(parallel), {"tokens": list(range(40))}
    medians = {}
    for name in ("broadcast_object", "CallChannel"):
        dist.barrier(group=parallel.cpu_group)
        seconds = []
        for _ in range(calls):
            began = time.perf_counter()
            if name == "broadcast_object":
                parallel.broadcast_object(call if rank == 0 else None)
            elif rank == 0:
                channel.send(call)
            else:
                channel.receive()
            seconds.append(time.perf_counter() - began)
        medians[name] = statistics.median(seconds) * 1e6
    if rank == 0:
        results.append(medians)
    dist.destroy_process_group()


def announce_latency(calls: int) -> dict[str, float]:
    """Median microseconds rank 0 spends per announced call, each way (two processes, idle ranks)."""
    import multiprocessing

    from kvasir.runtime.parallel.init import host_rendezvous

    store = host_rendezvous(2, 60)
    other = multiprocessing.get_context("spawn").Process(
        target=_announce_rank, args=(1, store.port, calls, None)
    )
    other.start()
    results: list[dict[str, float]] = []
    try:
        _announce_rank(0, store.port, calls, results, store)
    finally:
        other.join(60)
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--calls", type=int, default=500, help="announcements timed each way")
    args = parser.parse_args()
    print_header("tensor parallelism on CPU: decode step, call announcement and all-reduce", sys.argv)
    apply_threads(None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        build_random_llama(folder, TinyLlamaSpec())
        for batch in args.batch:
            for size in (1, 2):
                got = measure(folder, size, batch, args.steps)
                share = got["all_reduce_ms"] / got["step_ms"] if size > 1 else 0.0
                rows.append(
                    [
                        batch,
                        size,
                        f"{got['step_ms']:.2f}",
                        f"{got['broadcast_us']:.0f}" if size > 1 else "-",
                        f"{got['broadcast_bytes']:.0f}" if size > 1 else "-",
                        f"{got['all_reduce_ms']:.2f} ({share:.0%})" if size > 1 else "-",
                    ]
                )
    latency = announce_latency(args.calls)
    print_table(
        ["announcing a call", "rank 0 us (median)"],
        [[name, f"{us:.0f}"] for name, us in latency.items()],
    )
    print()
    print_table(
        ["batch", "TP", "decode step ms", "announce us", "announce bytes", "rank 0 in all-reduce ms (share)"],
        rows,
    )


if __name__ == "__main__":
    main()
