"""Kvasir's routing against round-robin, with real processes: three `kvasir serve` (the embedded
SmolLM2-135M) on loopback, and `kvasir router` in front of them.

Workload (the same shape in both phases, with different text so no cache carries over): `--groups`
system prompts of about `--system-tokens` tokens, each shared by `--users` users asking one short
question, plus `--chats` conversations of `--turns` turns, every turn extending the last. The
single questions arrive on a fixed schedule (`--rate` per second, shuffled); each chat turn is sent
when the previous answer has arrived. Phase 1: round-robin (the client cycles over the three
servers, as a Service would spread them); phase 2: through the router. Reported per phase: the
cached-token fraction (prefix-cache hits / prompt tokens looked up, from the servers' /metrics),
client-side TTFT p50/p99 of streamed chats, throughput, and requests per backend. Goals: >= 2x the
cached fraction, >= 30% lower TTFT p50, busiest backend <= 1.5x the least busy one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import percentile, print_header, print_table
from _served import free_port, served

# Common English words (one or two tokens each), to build system prompts of a known length.
WORDS = [
    "time",
    "person",
    "year",
    "way",
    "day",
    "thing",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "government",
    "company",
    "number",
    "group",
    "problem",
    "fact",
    "answer",
    "question",
    "system",
    "program",
    "service",
    "customer",
    "order",
    "account",
    "policy",
    "support",
    "product",
    "team",
    "market",
    "report",
    "data",
    "network",
    "server",
    "request",
    "cache",
    "memory",
    "process",
    "record",
    "value",
    "result",
    "change",
    "level",
    "area",
    "money",
    "story",
    "month",
    "book",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "city",
    "community",
    "name",
    "president",
]


def system_prompt(rng: random.Random, tokens: int) -> str:
    return "You are the assistant of a support desk. Rules: " + " ".join(
        rng.choice(WORDS) for _ in range(tokens)
    )


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def _prefix_counters(url: str) -> tuple[float, float]:
    queries = hits = 0.0
    for line in _get(url + "/metrics").splitlines():
        if line.startswith("kvasir_prefix_cache_queries_total{"):
            queries += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvasir_prefix_cache_hits_total{"):
            hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


@contextlib.contextmanager
def router_over(backends: list[str]) -> Iterator[str]:
    port = free_port()
    command = [
        sys.executable, "-m", "kvasir.cli", "router", "--host", "127.0.0.1", "--port", str(port),
        "--backends", ",".join(backends), "--log-level", "warning", "--scrape-interval", "0.5",
    ]  # fmt: skip
    process = subprocess.Popen(command, env={**os.environ, "PYTHONSAFEPATH": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                _get(url + "/ready")
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("kvasir router did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(30)


async def _chat(
    session: object, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str]:
    """(TTFT seconds, answer text) of one streamed chat completion."""
    import json

    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    began = time.perf_counter()
    first = None
    text = []
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:  # type: ignore[attr-defined]
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                choices = event.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    first = first or time.perf_counter()
                    text.append(choices[0]["delta"]["content"])
    return (first or time.perf_counter()) - began, "".join(text)


async def run_phase(targets: list[str], seed: int, args: argparse.Namespace) -> dict[str, object]:
    """Play the workload against `targets` (one URL: the router; several: round-robin over them)."""
    import aiohttp

    rng = random.Random(seed)
    groups = [system_prompt(rng, args.system_tokens) for _ in range(args.groups)]
    singles = [(g, u) for g in range(args.groups) for u in range(args.users)]
    rng.shuffle(singles)
    chat_systems = [system_prompt(rng, args.system_tokens // 4) for _ in range(args.chats)]
    ttfts: list[float] = []
    sent = Counter[str]()
    turn = 0

    def target() -> str:
        nonlocal turn
        turn += 1
        url = targets[turn % len(targets)]
        sent[url] += 1
        return url

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def single(delay: float, group: int, user: int) -> None:
            await asyncio.sleep(delay)
            messages = [
                {"role": "system", "content": groups[group]},
                {"role": "user", "content": f"User {user}: where is my order {user * 7919}?"},
            ]
            ttfts.append((await _chat(session, target(), messages, args.max_tokens))[0])

        async def chat(index: int) -> None:
            messages = [{"role": "system", "content": chat_systems[index]}]
            await asyncio.sleep(index / args.rate)
            for step in range(args.turns):
                messages.append(
                    {
                        "role": "user",
                        "content": f"Step {step}: tell me more about the {WORDS[(index + step) % len(WORDS)]}.",
                    }
                )
                ttft, answer = await _chat(session, target(), messages, args.max_tokens)
                ttfts.append(ttft)
                messages.append({"role": "assistant", "content": answer})
                await asyncio.sleep(0.5)

        began = time.perf_counter()
        await asyncio.gather(
            *(single(i / args.rate, g, u) for i, (g, u) in enumerate(singles)),
            *(chat(i) for i in range(args.chats)),
        )
        wall = time.perf_counter() - began
    return {"ttfts": ttfts, "wall": wall, "requests": len(ttfts), "sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--users", type=int, default=3, help="users sharing each system prompt")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rate", type=float, default=1.0, help="single questions per second")
    parser.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="per server")
    args = parser.parse_args()
    print_header("routing: round-robin vs kvasir router, three real servers", sys.argv)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(served("embedded", 4096, args.kv_cache_bytes))[0] for _ in range(3)]
        results = {}
        for name, seed in (("round-robin", 1), ("kvasir router", 2)):
            before = {url: _prefix_counters(url) for url in servers}
            if name == "round-robin":
                outcome = asyncio.run(run_phase(servers, seed, args))
                per_backend = [outcome["sent"][url] for url in servers]  # type: ignore[index]
            else:
                with router_over(servers) as router:
                    outcome = asyncio.run(run_phase([router], seed, args))
                    routed = _get(router + "/metrics")
                # The router labels backends by their index in --backends (not their address).
                per_backend = [
                    sum(
                        float(line.rsplit(" ", 1)[1])
                        for line in routed.splitlines()
                        if line.startswith(f'kvasir_router_backend_requests_total{{backend="{index}"}}')
                    )
                    for index in range(len(servers))
                ]
            after = {url: _prefix_counters(url) for url in servers}
            queries = sum(after[u][0] - before[u][0] for u in servers)
            hits = sum(after[u][1] - before[u][1] for u in servers)
            results[name] = (outcome, hits / queries if queries else float("nan"), per_backend)
    rows = []
    for name, (outcome, cached, per_backend) in results.items():
        ttfts = outcome["ttfts"]  # type: ignore[index]
        rows.append([
            name, cached, percentile(ttfts, 50), percentile(ttfts, 99), outcome["requests"] / outcome["wall"],  # type: ignore[operator]
            " / ".join(str(int(n)) for n in per_backend),
        ])  # fmt: skip
    print_table(
        ["routing", "cached fraction", "TTFT p50 s", "TTFT p99 s", "requests/s", "requests per backend"], rows
    )
    rr, kv = rows
    print(
        f"cached fraction: {kv[1] / rr[1]:.2f}x round-robin's (goal >= 2x)"
        if rr[1]
        else "round-robin cached nothing"
    )
    print(f"TTFT p50: {1 - kv[2] / rr[2]:+.0%} lower than round-robin (goal >= 30%)")
    loads = [float(n) for n in kv[5].split(" / ")]
    print(f"busiest / least busy backend: {max(loads) / max(min(loads), 1):.2f} (goal <= 1.5)")


if __name__ == "__main__":
    main()
