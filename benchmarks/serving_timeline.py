"""Where a streamed token's time goes between the engine's step and the SSE chunk the client reads.

One `kvasir serve` (CPU, the embedded GGUF unless `--model`) runs under benchmarks/_timeline_server.py,
which stamps `time.monotonic()` when the model runner's step starts and ends, when the engine's
step returns (scheduler update and detokenization done), when the event loop takes the step's
outputs, and when a chunk is encoded as an SSE event; the client stamps each chunk it reads (one
clock for all processes on Linux). Streams of `--tokens` tokens run at each concurrency level; for
every chunk after a stream's first, the stages it went through are matched to the latest stamps
before it, and their medians printed next to the client's inter-token latency (ITL). The same engine, built
in this process, runs the same streams offline (`LLMEngine.generate`), its rounds alternating with
the server's, for the step time without a server around it.

    python benchmarks/serving_timeline.py [--concurrency 1 8] [--tokens 64] [--requests 3]
        [--threads 1] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from _served import free_port

PROMPT = "Explain in detail how a refrigerator keeps food cold."
STAGES = [
    ("runner step (model + sampling)", "execute_start", "execute_end"),
    ("engine: update + detokenize", "execute_end", "step_end"),
    ("engine thread -> event loop", "step_end", "delivered"),
    ("event loop: queue -> SSE chunk", "delivered", "encoded"),
    ("chunk -> client read", "encoded", "received"),
]


async def stream(url: str, tokens: int) -> list[float]:
    import httpx

    body = {
        "model": "m", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
        "ignore_eos": True,
    }  # fmt: skip
    stamps = []
    async with (
        httpx.AsyncClient(timeout=600) as client,
        client.stream("POST", url + "/v1/completions", json=body) as response,
    ):
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                stamps.append(time.monotonic())
    return stamps


async def load(url: str, concurrency: int, tokens: int, requests: int) -> list[list[float]]:
    results: list[list[float]] = []
    for _ in range(requests):
        results += await asyncio.gather(*(stream(url, tokens) for _ in range(concurrency)))
    return results


def serve(args: argparse.Namespace, timeline: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        sys.executable, str(Path(__file__).resolve().parent / "_timeline_server.py"),
        "--model", args.model, "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--max-model-len", "2048", "--num-kv-blocks", "512",
        "--threads", str(args.threads), *args.serve_args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "KVASIR_THREADS")}
    env |= {"PYTHONSAFEPATH": "1", "KVASIR_TIMELINE_FILE": str(timeline)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        if process.poll() is not None or time.time() > deadline:
            raise RuntimeError("server did not become ready")
        try:
            with urllib.request.urlopen(url + "/ready") as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.3)


def stage_times(stamps: dict[str, list[float]], received: list[list[float]]) -> dict[str, list[float]]:
    """Per stage, its duration for every chunk after a stream's first (latest stamps before it)."""
    durations: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    durations["client ITL"] = []
    durations["runner step start to start"] = []
    for chunks in received:
        for previous, now in itertools.pairwise(chunks):
            durations["client ITL"].append(now - previous)
            times = {"received": now}
            for _, start, end in reversed(STAGES):
                series = stamps[start]
                index = bisect.bisect_right(series, times[end]) - 1
                times[start] = series[index]
            for name, start, end in STAGES:
                durations[name].append(times[end] - times[start])
            starts = stamps["execute_start"]
            index = bisect.bisect_right(starts, times["execute_start"]) - 1
            if index > 0:
                durations["runner step start to start"].append(starts[index] - starts[index - 1])
    return durations


class OfflineEngine:
    """The same engine in this process, run by `LLMEngine.generate`: its steps without a server."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from kvasir.runtime.engine.llm_engine import LLMEngine
        from kvasir.runtime.engine_args import add_engine_args, engine_config_from_args
        from kvasir.runtime.sample.params import SamplingParams

        torch.set_num_threads(args.threads)
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        flags = [
            "--model",
            args.model,
            "--device",
            "cpu",
            "--max-model-len",
            "2048",
            "--num-kv-blocks",
            "512",
        ]
        self.engine = LLMEngine(engine_config_from_args(parser.parse_args([*flags, *args.serve_args])))
        self.params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
        self.engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))

    def round(self, concurrency: int) -> tuple[list[float], list[float]]:
        """(runner step durations, step start-to-start gaps) of one batch of `concurrency` streams."""
        runner = self.engine.runner
        execute = runner.execute
        spans: list[tuple[float, float]] = []

        def timed(plan: object) -> object:
            started = time.monotonic()
            result = execute(plan)  # type: ignore[arg-type]
            spans.append((started, time.monotonic()))
            return result

        runner.execute = timed  # type: ignore[method-assign]
        try:
            self.engine.generate([PROMPT] * concurrency, self.params)
        finally:
            del runner.execute
        decode = spans[1:]  # after the prefill
        gaps = [later[0] - earlier[0] for earlier, later in itertools.pairwise(decode)]
        return [end - start for start, end in decode], gaps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3, help="rounds of `concurrency` streams")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("serve_args", nargs="*", help="extra `kvasir serve` flags (after --)")
    args = parser.parse_args()
    print_header("serving: one token's path from the engine step to the SSE chunk")
    with tempfile.TemporaryDirectory() as folder:
        timeline = Path(folder) / "timeline.json"
        process, url = serve(args, timeline)
        offline = OfflineEngine(args)
        received: dict[int, list[list[float]]] = {c: [] for c in args.concurrency}
        offline_steps: dict[int, tuple[list[float], list[float]]] = {c: ([], []) for c in args.concurrency}
        try:
            asyncio.run(load(url, 1, 8, 1))  # warm-up
            for concurrency in args.concurrency:
                for _ in range(args.requests):  # server and offline rounds alternate (ABAB)
                    received[concurrency] += asyncio.run(load(url, concurrency, args.tokens, 1))
                    steps, gaps = offline.round(concurrency)
                    offline_steps[concurrency][0].extend(steps)
                    offline_steps[concurrency][1].extend(gaps)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
        stamps = json.loads(timeline.read_text())
    rows = []
    for concurrency, chunks in received.items():
        durations = stage_times(stamps, chunks)
        durations["offline: runner step"], durations["offline: step start to start"] = offline_steps[
            concurrency
        ]
        for name, values in durations.items():
            rows.append([concurrency, name, 1000 * statistics.median(values), 1000 * statistics.mean(values)])
    print_table(["concurrency", "stage", "p50 ms", "mean ms"], rows)


if __name__ == "__main__":
    main()
