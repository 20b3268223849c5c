"""Fit the simulator's `cpu-embedded` replica profile on this machine (Vidur's approach): run the
real engine (the embedded SmolLM2-135M, on the CPU) over a mix of prompt lengths and batch sizes,
time every step with what it scheduled, and fit

    step time = base + per_token x batched tokens + per_kv_token x KV tokens read + per_seq x sequences

by non-negative least squares. Prints the fit and its error on held-out steps, and writes the
profile JSON (default: simulator/profiles/cpu-embedded.json).

    OMP_NUM_THREADS=1 python benchmarks/fit_cpu_profile.py [--output PATH] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header

REPO = Path(__file__).resolve().parents[1]


def measure_steps(
    threads: int, seed: int, kv_cache_bytes: int
) -> tuple[list[tuple[int, int, int, float]], Any]:
    """(batched tokens, KV tokens read, sequences, seconds) of every step of a mixed workload."""
    import torch

    from kvasir.runtime.config import EngineConfig
    from kvasir.runtime.engine import LLMEngine
    from kvasir.runtime.loader.embedded import embedded_model_path
    from kvasir.runtime.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    config = EngineConfig(
        model=str(embedded_model_path()), device="cpu", max_model_len=2048, kv_cache_bytes=kv_cache_bytes
    )
    started = time.perf_counter()
    engine = LLMEngine(config)
    load_seconds = time.perf_counter() - started
    rng = random.Random(seed)
    scheduler = engine.scheduler
    original = scheduler.schedule
    planned: list[Any] = []

    def schedule() -> Any:
        plan = original()
        planned.append(plan)
        return plan

    scheduler.schedule = schedule  # type: ignore[method-assign]
    samples: list[tuple[int, int, int, float]] = []
    # Waves of requests: different batch sizes, prompt lengths and output lengths, so that prefill
    # chunks, mixed steps and decode at many batch sizes and contexts are all measured.
    for wave, (count, prompt_len, output_len) in enumerate(
        [
            (1, 64, 64),
            (4, 256, 96),
            (8, 32, 128),
            (16, 128, 64),
            (2, 1024, 32),
            (24, 64, 48),
            (8, 512, 64),
            (32, 16, 96),
        ]
    ):
        for i in range(count):
            tokens = [
                rng.randrange(100, 40000) for _ in range(max(1, int(prompt_len * rng.uniform(0.7, 1.3))))
            ]
            params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
            engine.add_request(f"w{wave}-{i}", None, params, prompt_token_ids=tokens)
        while engine.scheduler.has_unfinished_requests():
            before = len(planned)
            began = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - began
            if len(planned) == before + 1 and not planned[-1].is_empty:
                plan = planned[-1]
                kv = sum(item.start + item.num_tokens for item in plan.scheduled)
                samples.append((plan.num_batched_tokens, kv, len(plan.scheduled), elapsed))
    return samples, (engine, load_seconds)


def fit(samples: list[tuple[int, int, int, float]]) -> list[float]:
    """Least squares of seconds on [1, tokens, kv, seqs], dropping any term that comes out negative
    (a step never gets faster with more work) and refitting the rest."""
    import numpy as np

    a = np.array([[1.0, t, k, s] for t, k, s, _ in samples])
    b = np.array([sec for *_, sec in samples])
    active = [0, 1, 2, 3]
    while True:
        solution, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        negative = [column for column, value in zip(active, solution, strict=True) if value < 0]
        if not negative:
            break
        active = [column for column in active if column not in negative]
    coefficients = [0.0] * 4
    for column, value in zip(active, solution, strict=True):
        coefficients[column] = float(value)
    return coefficients


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", default=str(REPO / "simulator" / "profiles" / "cpu-embedded.json"))
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default: 1, as the server uses)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    args = parser.parse_args()
    print_header("fit the cpu-embedded replica profile")
    samples, (engine, load_seconds) = measure_steps(args.threads, args.seed, args.kv_cache_bytes)
    rng = random.Random(1)
    rng.shuffle(samples)
    held_out, train = samples[: len(samples) // 5], samples[len(samples) // 5 :]
    base, per_token, per_kv, per_seq = fit(train)
    errors = []
    for tokens, kv, seqs, seconds in held_out:
        predicted = base + per_token * tokens + per_kv * kv + per_seq * seqs
        errors.append(abs(predicted - seconds) / seconds)
    print(
        f"{len(samples)} steps measured ({len(train)} fitted, {len(held_out)} held out); model load {load_seconds:.1f}s"
    )
    print(
        f"base {base * 1e3:.3f} ms, per token {per_token * 1e6:.2f} us, per KV token {per_kv * 1e9:.2f} ns, per sequence {per_seq * 1e6:.2f} us"
    )
    print(
        f"held-out relative error: median {statistics.median(errors):.1%}, p90 {sorted(errors)[int(0.9 * len(errors))]:.1%}"
    )
    config = engine.config
    profile = {
        "name": "cpu-embedded",
        "description": (
            f"the embedded SmolLM2-135M on {args.threads} CPU thread(s), fitted by benchmarks/fit_cpu_profile.py "
            f"on {len(samples)} measured engine steps (held-out median error {statistics.median(errors):.0%})"
        ),
        "step": {
            "base_s": base,
            "per_token_s": per_token,
            "per_kv_token_s": per_kv,
            "per_seq_s": per_seq,
            "weights_s": 0.0,
        },
        "num_kv_blocks": engine.runner.num_blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": engine.runner.max_num_batched_tokens,
        "max_model_len": engine.max_model_len,
        "cold_start_s": round(max(5.0, load_seconds + 2.0), 1),
        "gpus": 1,
    }
    Path(args.output).write_text(json.dumps(profile, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
