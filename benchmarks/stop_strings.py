"""What the longest stop list a request may send costs the other requests: a request's time to
generate 96 tokens through a real `kvasir serve` (the embedded model, one CPU thread) while a
second request runs beside it, first with no stop strings, then with the most the server accepts
(64 strings, 4096 characters in all, none of which occurs). Goal: ratio <= 1.2. A list over the
limits is refused with 400 before it costs anything (tested in tests/runtime/server).

    OMP_NUM_THREADS=1 python benchmarks/stop_strings.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from _served import served

from kvasir.runtime.sample.params import MAX_STOP_CHARACTERS, MAX_STOP_STRINGS

TOKENS = 96


async def _pair(url: str, stop: list[str]) -> float:
    """Seconds the plain request takes while the other (with `stop`) runs beside it."""
    import time

    import aiohttp

    def body(extra: dict[str, object]) -> dict[str, object]:
        return {"model": "m", "prompt": "Once upon a time", "max_tokens": TOKENS, "ignore_eos": True, **extra}

    async with aiohttp.ClientSession() as session:

        async def timed() -> float:
            began = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body({})) as response:
                assert response.status == 200, await response.text()
                await response.read()
            return time.perf_counter() - began

        async def other() -> None:
            async with session.post(f"{url}/v1/completions", json=body({"stop": stop})) as response:
                assert response.status == 200, await response.text()
                await response.read()

        elapsed, _ = await asyncio.gather(timed(), other())
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print_header("stop strings: a concurrent request's latency beside the longest accepted stop list")
    length = MAX_STOP_CHARACTERS // MAX_STOP_STRINGS
    longest = [f"\x01{i:0{length - 1}d}" for i in range(MAX_STOP_STRINGS)]  # never generated
    assert sum(map(len, longest)) <= MAX_STOP_CHARACTERS
    timings: dict[str, list[float]] = {"no stop strings": [], f"{MAX_STOP_STRINGS} x {length} characters": []}
    with served("embedded", 2048, 256 << 20) as (url, _):
        asyncio.run(_pair(url, []))  # warm-up
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            for name, stop in zip(timings, ([], longest), strict=True):
                timings[name].append(asyncio.run(_pair(url, stop)))
    base = statistics.median(timings["no stop strings"])
    rows = [
        [name, statistics.median(t), min(t), max(t), statistics.median(t) / base]
        for name, t in timings.items()
    ]
    print_table(
        ["the other request's stop list", "median s", "min s", "max s", "vs none (goal <= 1.2)"], rows
    )


if __name__ == "__main__":
    main()
