"""The embedded model's cold start, measured: launch `kvasir serve` (SmolLM2-135M, the settings the
`cpu-embedded` profile was fitted with) several times and read how long each phase took, from
the server's own metric (`kvasir_time_to_ready_seconds{phase}`: process start to loading, model
files and tokenizer, weights, KV cache, kernel warm-up and CUDA graphs on a GPU, the rest of the
engine, the warm-up request, total), next to what a client sees (launch to the first 200 from
/ready). Prints which phase dominates. `--update-profile` writes the median into the `cpu-embedded` profile's
`cold_start_s`, plus what a pod adds that a process launched here does not: the pod is Ready at
the first startup probe after the server is (the operator's pods probe /ready every
STARTUP_PERIOD_SECONDS, 10 s, at a phase unrelated to the process start: half a period on
average). Not counted: scheduling and creating the container (image cached), which no
benchmark here measures, and any wait for the readiness probe after the startup probe passes. `--device cuda` measures a GPU start (CUDA graph capture included).

    OMP_NUM_THREADS=1 python benchmarks/cold_start.py [--runs 5] [--device cpu|cuda] [--update-profile]
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

from kvasir.operator.children.deployment import STARTUP_PERIOD_SECONDS

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "simulator" / "profiles" / "cpu-embedded.json"
# A pod is Ready at the first startup probe after its server is: half the probe's period on
# average (its ticks are unrelated to when the process started).
PROBE_WAIT_S = STARTUP_PERIOD_SECONDS / 2
METRIC = re.compile(r'^kvasir_time_to_ready_seconds\{[^}]*phase="(\w+)"[^}]*\} ([0-9.e+-]+)$', re.MULTILINE)


def one_start(device: str, max_model_len: int, kv_cache_bytes: int) -> dict[str, float]:
    """Seconds per phase of one cold start (a fresh process), and the client's launch-to-ready."""
    port = free_port()
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable, "-m", "kvasir.cli", "serve", "--model", "embedded", "--served-model-name", "m",
        "--host", "127.0.0.1", "--port", str(port), "--device", device,
        "--max-model-len", str(max_model_len), "--kv-cache-bytes", str(kv_cache_bytes),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        launched = time.perf_counter()
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 600
            while True:
                if server.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"kvasir serve did not become ready:\n{log.read()[-3000:]}")
                try:
                    with urllib.request.urlopen(f"{url}/ready") as response:
                        if response.status == 200:
                            break
                except OSError:
                    time.sleep(0.05)
            ready = time.perf_counter() - launched
            with urllib.request.urlopen(f"{url}/metrics") as response:
                metrics = response.read().decode()
        finally:
            server.terminate()
            server.wait(timeout=60)
        log.seek(0)
        text = log.read()
    phases = {f"metric: {phase}": float(value) for phase, value in METRIC.findall(metrics)}
    if "metric: total" not in phases:
        raise RuntimeError(f"no kvasir_time_to_ready_seconds in /metrics:\n{text[-3000:]}")
    phases["client: launch to /ready 200"] = ready
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument(
        "--update-profile", action="store_true", help=f"write cold_start_s into {PROFILE.name}"
    )
    args = parser.parse_args()
    print_header(f"cold start of the embedded model ({args.device}, {args.runs} fresh processes)")
    runs = [one_start(args.device, args.max_model_len, args.kv_cache_bytes) for _ in range(args.runs)]
    names = list(dict.fromkeys(name for run in runs for name in run))
    rows = []
    total = statistics.median(run["metric: total"] for run in runs)
    for name in names:
        values = [run[name] for run in runs if name in run]
        median = statistics.median(values)
        rows.append([name, median, min(values), max(values), f"{median / total:.0%}"])
    print_table(["phase", "median s", "min s", "max s", "of the server's total"], rows)
    parts = {
        name: statistics.median(run[name] for run in runs)
        for name in names
        if name.startswith("metric: ") and name != "metric: total"
    }
    biggest = max(parts, key=lambda name: parts[name])
    print(
        f"\ndominant phase: {biggest.removeprefix('metric: ')} ({parts[biggest] / total:.0%} of {total:.2f} s)"
    )
    if args.update_profile:
        profile = json.loads(PROFILE.read_text())
        profile["cold_start_s"] = round(total + PROBE_WAIT_S, 1)
        PROFILE.write_text(json.dumps(profile, indent=2) + "\n")
        print(
            f"{PROFILE.relative_to(REPO)}: cold_start_s = {profile['cold_start_s']} (median total + {PROBE_WAIT_S:g} s, half the startup probe's period)"
        )


if __name__ == "__main__":
    main()
