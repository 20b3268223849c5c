"""Which CPU thread count serves fastest on this machine: one request through a real `kvasir
serve` (the embedded SmolLM2-135M, streaming 96 tokens, EOS ignored) at each thread count from 1
to the CPUs usable, and with the server's own default (`runtime/threads.py`), in one run.
Prints output tokens/s per setting and each against the default.

    python benchmarks/cpu_threads.py [--tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from _served import served, stream_completion

from kvasir.runtime.threads import available_cpus, default_threads


async def _tokens_per_second(url: str, tokens: int, repeats: int) -> float:
    import aiohttp

    rates = []
    async with aiohttp.ClientSession() as session:
        await stream_completion(session, url, [100] * 16, 4)  # warm-up
        for _ in range(repeats):
            stamps = await stream_completion(session, url, list(range(200, 232)), tokens)
            rates.append((len(stamps) - 2) / (stamps[-1] - stamps[1]))  # decode rate after the first token
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print_header("CPU threads: one request through kvasir serve at each thread count")
    cpus = available_cpus()
    default = default_threads(cpus)
    print(f"CPUs usable: {cpus:g}; the server's default: {default} thread(s)")
    rows = []
    results: dict[str, float] = {}
    settings: list[tuple[str, dict[str, str]]] = [("default", {})]
    settings += [(str(n), {"KVASIR_THREADS": str(n)}) for n in range(1, int(cpus) + 1)]
    if (os.cpu_count() or 1) > int(cpus):  # torch's own default: every core of the machine
        settings.append(("every core", {"KVASIR_THREADS": str(os.cpu_count())}))
    for name, env in settings:
        with served("embedded", 2048, 256 << 20, env=env, single_thread=False) as (url, _):
            results[name] = asyncio.run(_tokens_per_second(url, args.tokens, args.repeats))
    for name, rate in results.items():
        rows.append([name, rate, rate / results["default"]])
    print_table(["threads", "output tok/s (median)", "vs default"], rows)


if __name__ == "__main__":
    main()
