"""What `kvasir router` adds: p50 latency of a small request and requests/s on one core.

Two stub backends (benchmarks/_stub_backend.py, a raw asyncio server far cheaper than the router)
answer every completion at once. The same client (aiohttp, keep-alive) measures, in one run:
- latency, one request at a time: straight to a stub, then through the router; the difference of
  the medians is the router's added p50 (goal <= 1 ms);
- throughput: `--concurrency` requests kept in flight through the router for `--seconds`; the
  router is pinned to one core (`taskset`, when there is more than one), the client and stubs to
  the others (goal >= 2,000 small requests/s).
The prompt is a few hundred characters (the router hashes its blocks as for any request).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import percentile, print_header, print_table
from _served import free_port

HERE = Path(__file__).resolve().parent
BODY = {
    "model": "m",
    "prompt": "Summarise the following ticket for the on-call engineer. " * 6,
    "max_tokens": 1,
}


def _wait_ready(url: str, path: str) -> None:
    deadline = time.time() + 60
    while True:
        try:
            with urllib.request.urlopen(url + path) as response:
                if response.status == 200:
                    return
        except OSError:
            if time.time() > deadline:
                raise RuntimeError(f"{url} did not come up") from None
            time.sleep(0.1)


PIN = True


def _pin(cores: list[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores))] if PIN and len(os.sched_getaffinity(0)) > 1 else []


async def _latencies(url: str, count: int) -> list[float]:
    import aiohttp

    out = []
    async with aiohttp.ClientSession() as session:
        for _ in range(count + 20):  # the first 20 warm the connection up
            began = time.perf_counter()
            async with session.post(url + "/v1/completions", json=BODY) as response:
                await response.read()
                assert response.status == 200, response.status
            out.append(time.perf_counter() - began)
    return out[20:]


async def _throughput(url: str, concurrency: int, seconds: float) -> float:
    import aiohttp

    done = 0
    stop = time.perf_counter() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            async with session.post(url + "/v1/completions", json=BODY) as response:
                await response.read()
                if response.status == 200:
                    done += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        began = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return done / (time.perf_counter() - began)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (on a shared machine it gets less than a core)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="sequential requests per latency run")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--no-pin", action="store_true", help="let the OS place every process")
    args = parser.parse_args()
    print_header("router overhead", sys.argv)
    global PIN
    PIN = not args.no_pin
    cores = sorted(os.sched_getaffinity(0))
    router_core, other_cores = [cores[0]], (cores[1:] or cores)
    stubs, processes = [], []
    try:
        for _ in range(2):
            port = free_port()
            processes.append(
                subprocess.Popen(
                    [*_pin(other_cores), sys.executable, str(HERE / "_stub_backend.py"), str(port)]
                )
            )
            stubs.append(f"http://127.0.0.1:{port}")
        router_port = free_port()
        router = f"http://127.0.0.1:{router_port}"
        command = [
            *_pin(router_core), sys.executable, "-m", "kvasir.cli", "router", "--host", "127.0.0.1",
            "--port", str(router_port), "--backends", ",".join(stubs), "--log-level", "warning",
        ]  # fmt: skip
        processes.append(subprocess.Popen(command, env={**os.environ, "PYTHONSAFEPATH": "1"}))
        for url in stubs:
            _wait_ready(url, "/metrics")
        _wait_ready(router, "/ready")
        if PIN:
            os.sched_setaffinity(0, other_cores)
        direct = asyncio.run(_latencies(stubs[0], args.requests))
        routed = asyncio.run(_latencies(router, args.requests))
        rate_direct = asyncio.run(_throughput(stubs[0], args.concurrency, args.seconds / 2))
        router_pid = processes[-1].pid
        cpu_before = _cpu_seconds(router_pid)
        began = time.perf_counter()
        rate = asyncio.run(_throughput(router, args.concurrency, args.seconds))
        cpu_share = (_cpu_seconds(router_pid) - cpu_before) / (time.perf_counter() - began)
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)
    p50_direct, p50_routed = statistics.median(direct), statistics.median(routed)
    print(
        f"router pinned to core {router_core[0]}; client and stubs on {other_cores}" if PIN else "not pinned"
    )
    print_table(
        ["path", "p50 ms", "p99 ms", "requests/s"],
        [
            ["client -> stub", p50_direct * 1e3, percentile(direct, 99) * 1e3, rate_direct],
            ["client -> router -> stub", p50_routed * 1e3, percentile(routed, 99) * 1e3, rate],
        ],
    )
    added = (p50_routed - p50_direct) * 1e3
    print(f"added p50: {added:.3f} ms (goal <= 1 ms): {'met' if added <= 1.0 else 'NOT met'}")
    per_core = rate / cpu_share if cpu_share > 0 else float("nan")
    print(f"router throughput: {rate:,.0f} requests/s while the router got {cpu_share:.2f} of a core")
    print(
        f"per core of router CPU time: {per_core:,.0f} requests/s (goal >= 2,000): {'met' if per_core >= 2000 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
