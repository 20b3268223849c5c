"""Fit the simulator's `cpu-embedded` replica profile on this machine (Vidur's approach): measure
engine steps of the embedded SmolLM2-135M on the CPU over a mix of prompt lengths and batch sizes,
and fit

    step time = base + max(weights, per_token x batched tokens) + per_kv_token x KV tokens read
                + per_seq x sequences

(a decode step streams the weights whatever its few tokens; a prefill chunk is compute-bound). Prints the fit and its error on
held-out steps, and writes the profile JSON (default: simulator/profiles/cpu-embedded.json).

Two sources of steps:
- `--source server` (the default): a real `kvasir serve`, driven over HTTP. A decode step's time
  is the gap between two streamed chunks of a request in a steady batch, a prefill's the time to
  the first chunk of a lone request: what a client of a replica sees, HTTP, streaming and the
  engine thread's competition with the event loop included. This is what the simulator stands for.
- `--source engine`: `LLMEngine.step()` timed in this process, without the server around it.

    OMP_NUM_THREADS=1 python benchmarks/fit_cpu_profile.py [--source server|engine] [--output PATH]
"""

from __future__ import annotations

import argparse
import itertools
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


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _stream(session: Any, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    import time as clock

    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    stamps = [clock.perf_counter()]
    async with session.post(f"{url}/v1/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {"):
                stamps.append(clock.perf_counter())
    return stamps


def measure_served_steps(
    seed: int, kv_cache_bytes: int, max_model_len: int
) -> tuple[list[tuple[int, int, int, float]], dict[str, Any]]:
    """Steps of a real `kvasir serve`, seen from its clients (see the module docstring)."""
    import asyncio
    import os
    import subprocess
    import urllib.request

    import aiohttp

    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1"}
    command = [
        sys.executable, "-m", "kvasir.cli", "serve", "--model", "embedded", "--served-model-name", "m",
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
        "--max-model-len", str(max_model_len), "--kv-cache-bytes", str(kv_cache_bytes),
    ]  # fmt: skip
    started = time.perf_counter()
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(seed)
    samples: list[tuple[int, int, int, float]] = []

    async def run() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for length in (16, 64, 128, 256, 512, 1024):  # prefill: a lone request, one token out
                for _ in range(3):
                    prompt = [rng.randrange(200, 40000) for _ in range(length)]
                    stamps = await _stream(session, url, prompt, 1)
                    samples.append((length, length, 1, stamps[1] - stamps[0]))
            for batch in (1, 2, 4, 8, 16):  # steady decode: `batch` streams started together
                for context in (32, 256, 768):
                    prompts = [[rng.randrange(200, 40000) for _ in range(context)] for _ in range(batch)]
                    streams = await asyncio.gather(*(_stream(session, url, p, 48) for p in prompts))
                    # The gaps once every request is decoding (after the last first token).
                    first = max(s[1] for s in streams)
                    for stamps in streams:
                        gaps = [b - a for a, b in itertools.pairwise(stamps[1:]) if a >= first]
                        for index, gap in enumerate(gaps[:-2]):
                            kv = batch * (context + 8 + index)
                            samples.append((batch, kv, batch, gap))

    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/ready") as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        load_seconds = time.perf_counter() - started
        asyncio.run(run())
    finally:
        server.terminate()
        server.wait(timeout=60)
    # The engine's geometry, from the same settings the server used.
    from kvasir.runtime.config import EngineConfig

    config = EngineConfig(
        model="embedded", device="cpu", max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes
    )
    geometry = {
        "load_seconds": load_seconds,
        "max_model_len": max_model_len,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.batched_tokens_on("cpu"),
        "num_kv_blocks": None,
    }
    return samples, geometry


def fit(samples: list[tuple[int, int, int, float]]) -> list[float]:
    """[base, per_token, per_kv_token, per_seq, weights] of the profile's step model,

        base + max(weights, per_token x tokens) + per_kv_token x kv + per_seq x seqs,

    by a grid over (weights, per_token) with weighted least squares for the linear terms (relative
    error; every measured configuration weighs the same: a batch of 16 yields 16 gaps per step)."""
    import numpy as np

    tokens = np.array([t for t, _, _, _ in samples], dtype=float)
    kv = np.array([k for _, k, _, _ in samples], dtype=float)
    seqs = np.array([s for _, _, s, _ in samples], dtype=float)
    seconds = np.array([sec for *_, sec in samples])
    weights = 1.0 / (seconds * seqs)
    best: tuple[float, list[float]] | None = None
    for weight_s in np.linspace(0.0, float(np.percentile(seconds, 50)), 41):
        for per_token in np.geomspace(1e-5, 2e-2, 61):
            compute = np.maximum(weight_s, per_token * tokens)
            a = np.stack([np.ones_like(kv), kv, seqs], axis=1) * weights[:, None]
            b = (seconds - compute) * weights
            solution, *_ = np.linalg.lstsq(a, b, rcond=None)
            solution = np.maximum(solution, 0.0)
            predicted = solution[0] + compute + solution[1] * kv + solution[2] * seqs
            error = float(np.sum(((predicted - seconds) * weights) ** 2))
            if best is None or error < best[0]:
                best = (
                    error,
                    [
                        float(solution[0]),
                        float(per_token),
                        float(solution[1]),
                        float(solution[2]),
                        float(weight_s),
                    ],
                )
    assert best is not None
    return best[1]


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
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--source", choices=("server", "engine"), default="server")
    args = parser.parse_args()
    print_header(f"fit the cpu-embedded replica profile (steps measured on the {args.source})")
    samples, (engine, load_seconds) = measure_steps(args.threads, args.seed, args.kv_cache_bytes)
    geometry = {
        "load_seconds": load_seconds,
        "max_model_len": engine.max_model_len,
        "block_size": engine.config.block_size,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.runner.max_num_batched_tokens,
        "num_kv_blocks": engine.runner.num_blocks,
    }
    if args.source == "server":
        samples, served = measure_served_steps(args.seed, args.kv_cache_bytes, engine.max_model_len)
        geometry["load_seconds"] = served["load_seconds"]
    rng = random.Random(1)
    rng.shuffle(samples)
    held_out, train = samples[: len(samples) // 5], samples[len(samples) // 5 :]
    base, per_token, per_kv, per_seq, weights_s = fit(train)
    errors = []
    for tokens, kv, seqs, seconds in held_out:
        predicted = base + max(weights_s, per_token * tokens) + per_kv * kv + per_seq * seqs
        errors.append(abs(predicted - seconds) / seconds)
    print(
        f"{len(samples)} steps measured ({len(train)} fitted, {len(held_out)} held out); "
        f"start-up {geometry['load_seconds']:.1f}s"
    )
    print(
        f"base {base * 1e3:.3f} ms, weights {weights_s * 1e3:.1f} ms, per token {per_token * 1e6:.2f} us, "
        f"per KV token {per_kv * 1e9:.2f} ns, per sequence {per_seq * 1e6:.2f} us"
    )
    print(
        f"held-out relative error: median {statistics.median(errors):.1%}, p90 {sorted(errors)[int(0.9 * len(errors))]:.1%}"
    )
    profile = {
        "name": "cpu-embedded",
        "description": (
            f"the embedded SmolLM2-135M on {args.threads} CPU thread(s), fitted by benchmarks/fit_cpu_profile.py "
            f"on {len(samples)} steps measured on the {args.source} "
            f"(held-out median error {statistics.median(errors):.0%})"
        ),
        "step": {
            "base_s": base,
            "per_token_s": per_token,
            "per_kv_token_s": per_kv,
            "per_seq_s": per_seq,
            "weights_s": weights_s,
        },
        "num_kv_blocks": geometry["num_kv_blocks"],
        "block_size": geometry["block_size"],
        "max_num_seqs": geometry["max_num_seqs"],
        "max_num_batched_tokens": geometry["max_num_batched_tokens"],
        "max_model_len": geometry["max_model_len"],
        "cold_start_s": round(max(5.0, float(geometry["load_seconds"]) + 2.0), 1),
        "gpus": 1,
    }
    Path(args.output).write_text(json.dumps(profile, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
