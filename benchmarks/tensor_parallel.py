"""Tensor parallelism on the CPU: the all-reduce's share of a decode step at TP=2 (gloo).

    python benchmarks/tensor_parallel.py                     # the embedded model, batch 1 and 32
    python benchmarks/tensor_parallel.py --random-llama      # a random Llama (8 heads, 30 layers)
    python benchmarks/tensor_parallel.py --batches 1 8 32 --tokens 32 --rounds 3

Method. One engine at `--tensor-parallel-size 2` (rank 0 in this process, rank 1 spawned; gloo
over loopback), and one at size 1, run in turn: each round decodes `--tokens` greedy tokens for
each batch size on both. In this process the collectives the layers call (`all_reduce` after the
row-parallel o and down projections, `all_gather` of the LM head's logits) are timed with a wall
clock around each call; a decode step's share is their time over the wall time of
`ModelRunner.execute` on rank 0, medians over the steps. What rank 0 spends in a collective is the
transfer plus any wait for rank 1 to arrive at it (the ranks are not perfectly in step); both are
what tensor parallelism costs a step here. The ranks divide the cores between them (one torch
thread each on a 2-core machine); the size-1 engine's rounds run with all of them (torch's thread
count is set before each engine's round, as the engines set it when they start).

A CPU's all-reduce goes through gloo over TCP on loopback: a GPU's NCCL over NVLink is a different
machine, and these shares say nothing about it (docs/tensor-parallel.md).
"""

from __future__ import annotations

import argparse
import os
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
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.parallel.group import TensorParallel
from kvasir.runtime.sample.params import SamplingParams

PROMPT_TOKENS = 16


class CollectiveTimer:
    """Wall time of every all_reduce and all_gather this process makes (rank 0's), per step."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        for name in ("all_reduce", "all_gather"):
            setattr(TensorParallel, name, self._timed(getattr(TensorParallel, name)))

    def _timed(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def timed(group: TensorParallel, *args: Any, **kwargs: Any) -> Any:
            if group.size == 1:
                return real(group, *args, **kwargs)
            started = time.perf_counter()
            try:
                return real(group, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        return timed

    def take(self) -> tuple[float, int]:
        """Seconds and calls since the last take."""
        taken = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return taken


class StepTimes:
    """Wall time of each `execute` of an engine's runner, and the collectives' time within it."""

    def __init__(self, engine: LLMEngine, collectives: CollectiveTimer) -> None:
        self.steps: list[tuple[float, float, int]] = []  # (step s, collectives s, collective calls)
        real = engine.runner.execute

        def execute(plan: Any) -> Any:
            collectives.take()
            started = time.perf_counter()
            result = real(plan)
            elapsed = time.perf_counter() - started
            self.steps.append((elapsed, *collectives.take()))
            return result

        engine.runner.execute = execute  # type: ignore[method-assign]


def decode_round(
    engine: LLMEngine, times: StepTimes, batch: int, tokens: int
) -> list[tuple[float, float, int]]:
    """`batch` requests of `tokens` greedy tokens; the steps after the first (the prefill)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    first = len(times.steps)
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(PROMPT_TOKENS)]
        engine.add_request(f"r{time.monotonic_ns()}-{i}", None, params, prompt_token_ids=prompt)
    while engine.has_unfinished():
        engine.step()
    return times.steps[first + 1 :]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--random-llama",
        action="store_true",
        help="a random float32 Llama of SmolLM2-135M's width with 8 heads instead of the embedded model",
    )
    return parser.parse_args()


def model_path(args: argparse.Namespace, scratch: Path) -> str:
    if not args.random_llama:
        return str(embedded_model_path())
    spec = TinyLlamaSpec(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=8, num_kv_heads=4)
    build_random_llama(scratch / "llama", spec)
    return str(scratch / "llama")


def main() -> None:
    args = parse_args()
    collectives = CollectiveTimer()
    with tempfile.TemporaryDirectory() as scratch:
        model = model_path(args, Path(scratch))
        common: dict[str, Any] = {
            "model": model,
            "device": "cpu",
            "max_model_len": PROMPT_TOKENS + args.tokens + 16,
            "max_num_seqs": max(args.batches),
        }
        sharded = LLMEngine(EngineConfig(**common, tensor_parallel_size=2))
        threads = {"tp2": torch.get_num_threads(), "tp1": len(os.sched_getaffinity(0))}
        single = LLMEngine(EngineConfig(**common))
        print_header("Tensor parallelism on the CPU: TP=2 (gloo) against TP=1", sys.argv)
        print(f"model: {model}; torch threads: rank 0 at TP=2 {threads['tp2']}, TP=1 {threads['tp1']}")
        times = {"tp2": StepTimes(sharded, collectives), "tp1": StepTimes(single, collectives)}
        engines = {"tp2": sharded, "tp1": single}
        kept: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
        try:
            for round_index in range(args.rounds + 1):  # the first round warms up and is not kept
                for batch in args.batches:
                    for name, engine in engines.items():
                        torch.set_num_threads(threads[name])
                        steps = decode_round(engine, times[name], batch, args.tokens)
                        if round_index:
                            kept.setdefault((name, batch), []).extend(steps)
        finally:
            sharded.close()
            single.close()
    rows = []
    for batch in args.batches:
        tp2, tp1 = kept[("tp2", batch)], kept[("tp1", batch)]
        step2 = statistics.median(s for s, _, _ in tp2)
        step1 = statistics.median(s for s, _, _ in tp1)
        collective = statistics.median(c for _, c, _ in tp2)
        calls = statistics.median(n for _, _, n in tp2)
        share = statistics.median(c / s for s, c, _ in tp2)
        rows.append(
            [batch, f"{step1 * 1e3:.2f}", f"{step2 * 1e3:.2f}", f"{collective * 1e3:.2f}", f"{calls:.0f}",
             f"{share:.1%}", f"{step1 / step2:.2f}", len(tp2)]
        )  # fmt: skip
    print_table(
        ["batch", "TP=1 step ms", "TP=2 step ms", "collectives ms", "calls/step", "share of TP=2 step",
         "TP=2 speed-up", "steps"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
