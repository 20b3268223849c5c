"""Fit the simulator's `cpu-embedded` replica profile on this machine (Vidur's approach: profile
the steps, then interpolate): drive a real `kvasir serve` (the embedded SmolLM2-135M, one CPU
thread) over HTTP and measure what a client of a replica sees:

- a decode step: the gap between two streamed chunks once a batch of B requests, started
  together, is decoding (B = 1..16, short and long contexts);
- a prefill step: the time to the first chunk of a lone request of L prompt tokens (L = 64..1024);
  HTTP, tokenizer-free token-id prompts, streaming and the engine thread's competition with the
  event loop are all inside.

The profile's step model is then `token_curve(batched tokens) + per_kv_token x KV tokens read`:
the curve is the measured time per batched-token count at the short context (medians), the KV
term the common slope over contexts of the decode steps (least squares with one intercept per
batch size). Prints the measured points, the model's error on every measured step, and writes the
profile JSON (default: simulator/profiles/cpu-embedded.json).

    OMP_NUM_THREADS=1 python benchmarks/fit_cpu_profile.py [--output PATH] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from _served import served, stream_completion

REPO = Path(__file__).resolve().parents[1]
DECODE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16)
DECODE_CONTEXTS = (64, 512)
PREFILL_LENGTHS = (32, 64, 128, 256, 512, 1024)
DECODE_TOKENS = 32

# (kind, batched tokens, KV tokens read, seconds) of one measured step.
Step = tuple[str, int, int, float]


async def measure(url: str, rounds: int, seed: int, kv_capacity: int) -> list[Step]:
    """Lone prefills of each length and decode batches of each size and context that fits the KV
    cache (a batch that does not fit would preempt and measure a smaller one), in `rounds` rounds
    of shuffled order: on a shared machine the speed drifts, and a drift must not land on one
    configuration."""
    import aiohttp

    rng = random.Random(seed)
    steps: list[Step] = []

    def prompt(length: int) -> list[int]:
        return [rng.randrange(200, 40000) for _ in range(length)]

    decodes = []
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            if batch * (context + DECODE_TOKENS + 16) > kv_capacity:
                print(f"skipped: decode batch {batch} at context {context} does not fit the KV cache")
            else:
                decodes.append((batch, context))
    configs = [("prefill", length, 0) for length in PREFILL_LENGTHS] + [("decode", b, c) for b, c in decodes]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await stream_completion(session, url, prompt(64), 4)  # warm-up
        for _ in range(rounds):
            rng.shuffle(configs)
            for kind, size, context in configs:
                if kind == "prefill":
                    stamps = await stream_completion(session, url, prompt(size), 1)
                    steps.append(("prefill", size, size, stamps[1] - stamps[0]))
                    continue
                streams = await asyncio.gather(
                    *(stream_completion(session, url, prompt(context), DECODE_TOKENS) for _ in range(size))
                )
                # Only the gaps once every request is decoding (after the last first token), and
                # not the last ones (requests finishing leave a smaller batch).
                first = max(s[1] for s in streams)
                for stamps in streams:
                    gaps = [b - a for a, b in itertools.pairwise(stamps[1:]) if a >= first]
                    for index, gap in enumerate(gaps[:-2]):
                        steps.append(("decode", size, size * (context + 2 + index), gap))
    return steps


def fit(steps: list[Step]) -> tuple[list[tuple[int, float]], float, float]:
    """(token curve, per KV token seconds, per-token slope past the curve's end).

    The KV term is the median over batch sizes of (long-context gap - short-context gap) / KV
    difference, from per-configuration medians: robust to the configurations that never reached a
    steady batch. The curve's decode points are the short-context gaps moved to KV 0, its prefill
    points the lone prefills' times moved to KV 0. Measured points are kept as they are, even where
    a larger batch is cheaper (on this CPU a batch of 3 costs more than one of 4)."""
    decode: dict[tuple[int, int], list[tuple[int, float]]] = defaultdict(list)
    for kind, tokens, kv, seconds in steps:
        if kind == "decode":
            context = min(DECODE_CONTEXTS, key=lambda c: abs(kv / tokens - c))
            decode[(tokens, context)].append((kv, seconds))
    short, long = DECODE_CONTEXTS[0], DECODE_CONTEXTS[-1]
    batches = sorted({batch for batch, _ in decode})
    median: dict[tuple[int, int], tuple[float, float]] = {
        key: (statistics.median(kv for kv, _ in v), statistics.median(s for _, s in v))
        for key, v in decode.items()
    }
    slopes = [
        (median[(b, long)][1] - median[(b, short)][1]) / (median[(b, long)][0] - median[(b, short)][0])
        for b in batches
        if (b, long) in median and (b, short) in median
    ]
    per_kv = max(0.0, statistics.median(slopes))
    curve = [
        (b, statistics.median(s - per_kv * kv for kv, s in decode[(b, short)]))
        for b in batches
        if (b, short) in decode
    ]
    prefill: dict[int, list[float]] = defaultdict(list)
    for kind, tokens, kv, seconds in steps:
        if kind == "prefill" and tokens > batches[-1]:
            prefill[tokens].append(seconds - per_kv * kv)
    curve += [(tokens, statistics.median(values)) for tokens, values in sorted(prefill.items())]
    (n0, s0), (n1, s1) = curve[-2], curve[-1]
    return curve, per_kv, max(0.0, (s1 - s0) / (n1 - n0))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", default=str(REPO / "simulator" / "profiles" / "cpu-embedded.json"))
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every configuration (default: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--save-steps", help="also write the measured steps (JSON) here")
    parser.add_argument("--from-steps", help="refit steps saved by --save-steps instead of measuring")
    args = parser.parse_args()
    print_header("fit the cpu-embedded replica profile (steps measured on a real kvasir serve)")
    geometry = engine_geometry(args.model, args.max_model_len, args.kv_cache_bytes)
    if args.from_steps:
        saved = json.loads(Path(args.from_steps).read_text())
        steps, ready_seconds = [tuple(s) for s in saved["steps"]], saved["ready_seconds"]
    else:
        with served(args.model, args.max_model_len, args.kv_cache_bytes) as (url, ready_seconds):
            kv_capacity = geometry["num_kv_blocks"] * geometry["block_size"]
            steps = asyncio.run(measure(url, args.rounds, args.seed, kv_capacity))
    if args.save_steps:
        Path(args.save_steps).write_text(json.dumps({"ready_seconds": ready_seconds, "steps": steps}))
    curve, per_kv, per_token = fit(steps)

    from kvasir.simulator.profile import StepModel

    model = StepModel(0.0, per_token, per_kv, 0.0, token_curve=tuple(curve))
    errors: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    measured: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for kind, tokens, kv, seconds in steps:
        context = min(DECODE_CONTEXTS, key=lambda c: abs(kv / tokens - c)) if kind == "decode" else tokens
        errors[(kind, tokens, context)].append(abs(model.step_time(tokens, kv, 0) - seconds) / seconds)
        measured[(kind, tokens, context)].append(seconds)
    print(f"{len(steps)} steps measured; server ready {ready_seconds:.1f}s after launch")
    print_table(
        ["step", "batched tokens", "context", "samples", "measured median (s)", "model median error"],
        [
            [
                kind,
                tokens,
                context,
                len(e),
                statistics.median(measured[(kind, tokens, context)]),
                statistics.median(e),
            ]
            for (kind, tokens, context), e in sorted(errors.items())
        ],
    )
    every = [e for values in errors.values() for e in values]
    median_error = statistics.median(every)
    print(f"per KV token {per_kv * 1e9:.1f} ns; past the curve {per_token * 1e6:.0f} us/token")
    print(f"median relative error over all {len(every)} steps: {median_error:.1%}")
    profile = {
        "name": "cpu-embedded",
        "description": (
            "the embedded SmolLM2-135M served on 1 CPU thread, fitted by benchmarks/fit_cpu_profile.py "
            f"on {len(steps)} steps of a real kvasir serve (median error {median_error:.0%})"
        ),
        "step": {
            "base_s": 0.0,
            "per_token_s": per_token,
            "per_kv_token_s": per_kv,
            "per_seq_s": 0.0,
            "weights_s": 0.0,
            "token_curve": [[n, round(s, 6)] for n, s in curve],
        },
        **geometry,
        "cold_start_s": round(max(5.0, ready_seconds + 2.0), 1),
        "gpus": 1,
    }
    Path(args.output).write_text(json.dumps(profile, indent=2) + "\n")
    print(f"wrote {args.output}")


def engine_geometry(model: str, max_model_len: int, kv_cache_bytes: int) -> dict[str, Any]:
    """The KV blocks and batch limits the server had, from an engine built with the same settings."""
    import torch

    from kvasir.runtime.config import EngineConfig
    from kvasir.runtime.engine.llm_engine import LLMEngine
    from kvasir.runtime.loader.embedded import embedded_model_path

    torch.set_num_threads(1)
    path = str(embedded_model_path()) if model == "embedded" else model
    config = EngineConfig(
        model=path, device="cpu", max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes
    )
    engine = LLMEngine(config)  # dropped on return: the server measured next has the machine to itself
    return {
        "num_kv_blocks": engine.runner.num_blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": engine.runner.max_num_batched_tokens,
        "max_model_len": engine.max_model_len,
    }


if __name__ == "__main__":
    main()
