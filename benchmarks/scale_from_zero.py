"""Scale from zero through `kvasir router`: requests held while no backend exists, then answered.

Three runs, each with a real `kvasir router` process:
1. **Hold and release.** `--requests` (20) requests, every other one streamed (the first is),
   reach a router whose only backend does not exist yet; each is sent once the previous one is
   held (the router's `kvasir_router_held_requests`), so their arrival order is known. Non-streamed
   ones use the official openai client with its default timeout (600 s) and no retries; streamed
   ones a raw SSE reader that sees the heartbeat comments. `--start-after` (5) seconds after the
   first request, `kvasir serve` (the embedded model by default) starts on the backend's address;
   a poller asks its /ready every 10 ms to time its readiness. The backend runs `--max-num-seqs 1`
   by default, so it answers one request at a time, in the order it admitted them: the answers'
   order is the order the router released them in. Reported: all answered, in order; the first
   request's first token minus the backend's readiness; the longest silence on a held stream.
2. **Full queue.** `--max-held-requests 10`, no backend: ten requests held, then an eleventh;
   reported: its status and how long it took.
3. **Hold timeout.** `--hold-timeout 3`, no backend: one request and one stream; reported: when
   the 503 (and the stream's error event) came.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import openai
from _common import print_header, print_table
from _served import free_port

ENV = {**os.environ, "PYTHONSAFEPATH": "1"}
WAIT = 300.0  # the bound on every wait of this script


@contextlib.contextmanager
def router(backend: str, *flags: str) -> Iterator[str]:
    port = free_port()
    command = [
        sys.executable, "-m", "kvasir.cli", "router", "--port", str(port), "--backends", backend,
        "--log-level", "warning", *flags,
    ]  # fmt: skip
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: _status(f"{url}/health") == 200, "the router did not start")
        yield url
    finally:
        process.kill()  # the held clients of runs 2 and 3 are cut here; run 1 has none left
        process.wait(60)


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _until(condition: object, what: str, interval: float = 0.01) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(interval)


def _held(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvasir_router_held_requests "):
            return float(line.split()[1])
    return -1.0


@dataclass
class Answer:
    index: int
    streamed: bool
    sent: float
    ok: bool = False
    first_content: float = float("nan")  # first token (streamed) or the whole answer
    first_event: float = float("nan")  # the backend's first SSE event (its answer has begun)
    done: float = float("nan")
    heartbeats: list[float] = field(default_factory=list)
    error: str = ""


def _chat(client: openai.OpenAI, index: int, max_tokens: int) -> Answer:
    answer = Answer(index, False, time.monotonic())
    try:
        reply = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"Say hello to number {index}."}],
            max_tokens=max_tokens,
        )
        answer.ok = bool(reply.choices and reply.choices[0].message.content is not None)
    except openai.OpenAIError as error:
        answer.error = f"{type(error).__name__}: {error}"
    answer.first_content = answer.done = time.monotonic()
    return answer


def _stream(url: str, index: int, max_tokens: int) -> Answer:
    answer = Answer(index, True, time.monotonic())
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"Say hello to number {index}."}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            now = time.monotonic()
            if line == ": heartbeat":
                answer.heartbeats.append(now)
            elif line.startswith("data: {") and '"error"' in line:
                answer.error = line[:300]
            elif line.startswith("data: {") and answer.first_content != answer.first_content:
                if answer.first_event != answer.first_event:
                    answer.first_event = now
                # The first token, not the first event (a chat stream opens with the role alone).
                choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    answer.first_content = now
            elif line == "data: [DONE]":
                answer.ok = reply.status_code == 200 and not answer.error
        answer.done = time.monotonic()
    return answer


def hold_and_release(args: argparse.Namespace) -> None:
    backend_port = free_port()
    backend = f"http://127.0.0.1:{backend_port}"
    with router(backend) as url, ThreadPoolExecutor(args.requests) as threads:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)  # default timeout
        futures: list[Future[Answer]] = []
        first_sent = time.monotonic()
        for index in range(args.requests):
            if index % 2 == 0:
                futures.append(threads.submit(_stream, url, index, args.max_tokens))
            else:
                futures.append(threads.submit(_chat, client, index, args.max_tokens))
            _until(lambda count=index + 1: _held(url) == count, "a request was not held")
        time.sleep(max(0.0, first_sent + args.start_after - time.monotonic()))
        command = [
            sys.executable, "-m", "kvasir.cli", "serve", "--model", args.model, "--served-model-name", "m",
            "--host", "127.0.0.1", "--port", str(backend_port), "--device", "cpu",
            "--max-model-len", "1024", "--max-num-seqs", str(args.max_num_seqs),
        ]  # fmt: skip
        started = time.monotonic()
        server = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL)
        try:
            _until(
                lambda: server.poll() is not None or _status(f"{backend}/ready") == 200,
                "kvasir serve did not become ready",
            )
            if server.poll() is not None:
                raise RuntimeError(f"kvasir serve exited ({server.returncode}): {' '.join(command)}")
            ready = time.monotonic()
            answers = [future.result(WAIT) for future in futures]
        finally:
            server.terminate()
            server.wait(60)
    print(
        f"backend started {started - first_sent:.2f} s after the first request, ready {ready - started:.1f} s later"
    )
    rows = []
    for a in answers:
        # While held: from the request to each heartbeat, and on to the backend's first event.
        marks = [a.sent, *a.heartbeats, a.first_event]
        silences = [later - earlier for earlier, later in itertools.pairwise(marks)]
        rows.append(
            (
                a.index,
                "stream" if a.streamed else "openai",
                "ok" if a.ok else a.error[:60],
                a.first_content - ready,
                a.done - ready,
                len(a.heartbeats),
                max(silences) if a.streamed else float("nan"),
            )
        )
    headers = (
        "#",
        "client",
        "result",
        "first token - ready s",
        "done - ready s",
        "heartbeats",
        "longest silence while held s",
    )
    print_table(headers, rows)
    done_order = [a.index for a in sorted(answers, key=lambda a: a.done)]
    print(f"all answered: {all(a.ok for a in answers)} ({sum(a.ok for a in answers)}/{len(answers)})")
    print(f"answers in arrival order: {done_order == sorted(done_order)} (completion order {done_order})")
    print(f"first TTFT - backend ready: {answers[0].first_content - ready:.3f} s (request 0, streamed)")
    streamed = [row[-1] for row in rows if row[1] == "stream"]
    print(f"longest silence on a held stream before the backend's first event: {max(streamed):.2f} s")
    print()


def full_queue() -> None:
    nothing = f"http://127.0.0.1:{free_port()}"
    # The router is killed before the threads are joined: that ends the ten held requests.
    with ThreadPoolExecutor(10) as threads, router(nothing, "--max-held-requests", "10") as url:
        body = {"model": "m", "prompt": "x"}
        for index in range(10):
            threads.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=WAIT)
            _until(lambda count=index + 1: _held(url) == count, "a request was not held")
        began = time.monotonic()
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT)
        took = time.monotonic() - began
        code = reply.json()["error"]["code"]
        print(
            f"maxHeld 10, the 11th request: {reply.status_code} {code}, Retry-After {reply.headers.get('retry-after')}, in {took * 1000:.1f} ms"
        )
        print()


def hold_timeout() -> None:
    nothing = f"http://127.0.0.1:{free_port()}"
    with router(nothing, "--hold-timeout", "3") as url, ThreadPoolExecutor(1) as threads:
        stream = threads.submit(_stream, url, 0, 4)
        began = time.monotonic()
        reply = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=WAIT)
        took = time.monotonic() - began
        streamed = stream.result(WAIT)
        code = json.loads(reply.content)["error"]["code"]
        print(
            f"hold 3 s, no backend: {reply.status_code} {code}, Retry-After {reply.headers.get('retry-after')}, after {took:.3f} s"
        )
        print(
            f"hold 3 s, a stream: error event after {streamed.done - streamed.sent:.3f} s ({streamed.error[:80]})"
        )
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument(
        "--start-after",
        type=float,
        default=5.0,
        help="seconds from the first request to kvasir serve's start",
    )
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--max-num-seqs", type=int, default=1, help="1: answers in the order admitted")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--only", choices=("release", "full", "timeout"), help="run one part")
    args = parser.parse_args()
    print_header("scale from zero through kvasir router")
    if args.only in (None, "release"):
        hold_and_release(args)
    if args.only in (None, "full"):
        full_queue()
    if args.only in (None, "timeout"):
        hold_timeout()


if __name__ == "__main__":
    main()
