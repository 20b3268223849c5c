"""HTTP overhead and /health latency under load, in one run on one machine.

The same workload (`--requests` prompts of about `--prompt-tokens` tokens, `--output-tokens` each,
EOS ignored, all submitted at once) runs through the offline engine (`LLMEngine.generate`, in this
process) and through streaming HTTP (`kvasir serve` in a subprocess, one SSE stream per request,
tokens counted from `usage`). Rounds alternate offline and HTTP so that a noisy neighbour on a
shared machine hits both alike. Reported: the median over rounds of each round's HTTP / offline
ratio, and the ratio of the best rounds (the least disturbed); goal >= 0.9. While the HTTP rounds
keep the engine saturated, a probe calls `/health` every `--probe-interval` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import percentile, print_header, print_table
from serving_server import ServerProcess


def prompts(count: int, prompt_tokens: int) -> list[str]:
    # Distinct first words: no two prompts share a full KV block, so the prefix cache does not help.
    return [f"{i} " + "word " * (prompt_tokens - 2) for i in range(count)]


def offline_round(engine: object, texts: list[str], output_tokens: int) -> float:
    """Output tokens per second of one offline batch."""
    from kvasir.runtime.sample.params import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0)
    started = time.perf_counter()
    results = engine.generate(texts, params)  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - started
    return sum(len(c.token_ids) for r in results for c in r.choices) / elapsed


async def http_round(
    url: str, model: str, texts: list[str], output_tokens: int, probe_interval: float, health: list[float]
) -> float:
    """Output tokens per second through streaming HTTP; appends /health latencies (s) while it runs."""
    import httpx

    async def one(client: httpx.AsyncClient, text: str) -> int:
        body = {
            "model": model,
            "prompt": text,
            "max_tokens": output_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        tokens = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith('data: {"id"') and '"usage":{' in line:
                    tokens = int(line.split('"completion_tokens":')[1].split(",")[0])
        return tokens

    async def probe(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            response = await client.get(url + "/health")
            health.append(time.perf_counter() - started)
            response.raise_for_status()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), probe_interval)

    limits = httpx.Limits(max_connections=len(texts) + 8)
    async with (
        httpx.AsyncClient(timeout=600, limits=limits) as client,
        httpx.AsyncClient(timeout=60) as prober,
    ):
        stop = asyncio.Event()
        probing = asyncio.ensure_future(probe(prober, stop))
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(client, text) for text in texts))
        elapsed = time.perf_counter() - started
        stop.set()
        await probing
    return sum(counts) / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--probe-interval", type=float, default=0.05)
    args = parser.parse_args(argv)
    print_header("serving: HTTP overhead and /health latency under load", argv)

    from kvasir.runtime.engine.llm_engine import LLMEngine
    from kvasir.runtime.engine_args import add_engine_args, engine_config_from_args

    engine_parser = argparse.ArgumentParser()
    add_engine_args(engine_parser)
    engine_args = ["--model", args.model, "--max-model-len", str(args.max_model_len)]
    engine_config = engine_config_from_args(engine_parser.parse_args(engine_args))
    texts = prompts(args.requests, args.prompt_tokens)
    offline = LLMEngine(engine_config)
    offline_round(offline, texts[:2], 4)  # warm-up, as the server does before it turns ready

    offline_rates: list[float] = []
    http_rates: list[float] = []
    health: list[float] = []
    with ServerProcess(*engine_args) as server:
        for _ in range(args.rounds):
            offline_rates.append(offline_round(offline, texts, args.output_tokens))
            http_rates.append(
                asyncio.run(
                    http_round(
                        server.url,
                        engine_config.model_name,
                        texts,
                        args.output_tokens,
                        args.probe_interval,
                        health,
                    )
                )
            )

    print(
        f"workload: {args.requests} requests at once, ~{args.prompt_tokens} prompt tokens, "
        f"{args.output_tokens} output tokens each, EOS ignored, greedy; {args.rounds} alternating rounds"
    )
    ratios = [h / o for h, o in zip(http_rates, offline_rates, strict=True)]
    print_table(
        ["round", *range(1, args.rounds + 1), "best"],
        [
            ["offline engine, output tok/s", *offline_rates, max(offline_rates)],
            ["streaming HTTP, output tok/s", *http_rates, max(http_rates)],
            ["HTTP / offline", *ratios, max(http_rates) / max(offline_rates)],
        ],
    )
    print(
        f"HTTP / offline output tokens/s: median of rounds {statistics.median(ratios):.3f}, "
        f"best rounds {max(http_rates) / max(offline_rates):.3f} (goal >= 0.9)\n"
    )
    print_table(
        ["/health probes while saturated", "p50 ms", "p99 ms", "max ms"],
        [
            [
                len(health),
                percentile(health, 50) * 1000,
                percentile(health, 99) * 1000,
                max(health) * 1000,
            ]
        ],
    )


if __name__ == "__main__":
    main()
