"""Where a CPU server's memory goes: resident set after each stage of start-up, then the server's.

Part 1 builds, in this process and in the order `kvasir serve` does, each stage of a server of
`--model` (default: the embedded SmolLM2-135M Q4_1 GGUF) and prints the resident set (VmRSS), its
peak so far (VmHWM: transient peaks count), and its anonymous and file-backed parts after each:
the interpreter, `import torch`, the server's modules, the model's files (config, tokenizer),
the weights, the engine (KV cache), a warm-up, a batch of `--concurrency` streams. The KV cache's
own size is printed beside it (it is as resident as the pages it has touched).

Part 2 starts `kvasir serve` itself (same flags as the llama.cpp comparison: 512 KV blocks of 16
tokens, one thread) and reads its VmRSS/VmHWM from /proc when ready and after streamed load at
each concurrency level, with its tokens/s and ITL. More servers run beside it, all resident, the
rounds visiting them in turn (ABAB): `--env NAME=VALUE` one with that environment (an allocator
setting such as MALLOC_ARENA_MAX), `--before REV` one from an older commit (extracted with
`git archive`, first on PYTHONPATH), for a before/after of memory and speed in one run.

    python benchmarks/server_memory.py [--model embedded] [--concurrency 1 8 32] [--tokens 64]
        [--env MALLOC_ARENA_MAX=2] [--before 7544fd6 --rounds 3] [--skip-stages]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from compare_checkouts import ROOT, package_tree
from gguf_vs_llama_cpp import KV_TOKENS, kvasir_server, measure, memory_mib, server

MIB = 2**20


def memory(pid: int | str = "self") -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile of a process, in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            values[key] = int(rest.split()[0]) / 1024
    return values


def startup_stages(args: argparse.Namespace, interpreter: dict[str, float]) -> None:
    rows: list[list[object]] = [
        [
            "python, this script",
            *(interpreter[k] for k in ("VmRSS", "VmHWM", "VmHWM", "RssAnon", "RssFile")),
            "",
        ]
    ]
    last_peak = interpreter["VmHWM"]

    def stage(name: str, note: str = "") -> None:
        nonlocal last_peak
        now = memory()
        rows.append(
            [name, now["VmRSS"], now["VmHWM"], now["VmHWM"] - last_peak, now["RssAnon"], now["RssFile"], note]
        )
        last_peak = now["VmHWM"]

    import torch

    torch.set_num_threads(1)
    stage("import torch")
    import uvicorn  # noqa: F401

    import kvasir.runtime.server.app  # noqa: F401
    from kvasir.runtime.engine.llm_engine import LLMEngine
    from kvasir.runtime.engine_args import add_engine_args, engine_config_from_args
    from kvasir.runtime.loader.model_files import open_model
    from kvasir.runtime.sample.params import SamplingParams

    stage("import the server (FastAPI, uvicorn, engine)")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = ["--model", args.model, "--device", "cpu", "--max-model-len", "2048"]
    config = engine_config_from_args(parser.parse_args([*flags, "--num-kv-blocks", str(KV_TOKENS // 16)]))
    files = open_model(config.model, quantization=config.quantization)
    stage("model files: config, tokenizer")
    engine = LLMEngine(config, files)
    del files
    kv_bytes = sum(t.numel() * t.element_size() for pair in engine.runner.kv_caches for t in pair)
    note = (
        f"KV cache {kv_bytes / MIB:.0f} MiB ({engine.runner.kv_cache_dtype}), "
        f"weights {engine.weights_report.weight_bytes / MIB:.0f} MiB"
    )
    stage("engine: weights loaded, KV cache allocated", note)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    engine.generate(["warm-up"], SamplingParams(max_tokens=4))
    stage("warm-up request")
    engine.generate(["Explain how a refrigerator keeps food cold."] * max(args.concurrency), params)
    stage(f"{max(args.concurrency)} requests of {args.tokens} tokens")
    print("start-up stages, in this process (MiB):")
    print_table(["stage", "RSS", "peak RSS", "peak grew by", "anonymous", "file-backed", "note"], rows)


def checkout(rev: str, folder: Path) -> dict[str, str]:
    """The environment that makes `kvasir` the tree of commit `rev` (extracted under `folder`)."""
    tree = folder / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return {"PYTHONPATH": str(package_tree(tree, folder / "packages"))}


def server_process(args: argparse.Namespace) -> None:
    """Every variant's server resident at once; at each concurrency level the rounds visit them in
    turn (ABAB), then each server's RSS and peak are read."""
    variants: dict[str, dict[str, str]] = {"this tree": {}}
    for setting in args.env:
        name, _, value = setting.partition("=")
        variants[setting] = {name: value}
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        if args.before:
            variants = {f"commit {args.before}": checkout(args.before, Path(folder)), **variants}
        urls, pids = {}, {}
        for label, extra in variants.items():
            command, env, url, health = kvasir_server(args.model, args.threads)
            pids[label] = stack.enter_context(server(command, {**env, **extra}, url, health))
            urls[label] = url
            asyncio.run(measure(url, 1, 8, 1))  # warm-up
        rows: list[list[object]] = [[label, "ready", "", "", *memory_mib(pid)] for label, pid in pids.items()]
        first = next(iter(variants))
        for concurrency in args.concurrency:
            rates: dict[str, list[float]] = {label: [] for label in variants}
            itl: dict[str, list[float]] = {label: [] for label in variants}
            for _ in range(args.rounds):
                for label, url in urls.items():
                    done = asyncio.run(measure(url, concurrency, args.tokens, 1))
                    rates[label].append(done.tokens_per_s)
                    itl[label] += done.itl
            for label, pid in pids.items():
                ratios = [ours / theirs for ours, theirs in zip(rates[label], rates[first], strict=True)]
                rows.append([
                    label, f"after {concurrency} streams", ", ".join(f"{r:.1f}" for r in rates[label]),
                    f"{1000 * statistics.median(itl[label]):.1f}" + (
                        f"; x{statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
                        if label != first else ""
                    ),
                    *memory_mib(pid),
                ])  # fmt: skip
    print(f"`kvasir serve` processes, all resident, rounds alternating (MiB; tok/s against {first!r}):")
    print_table(
        ["server", "when", "tok/s by round", "ITL p50 ms; tok/s ratio", "RSS", "peak RSS (VmHWM)"], rows
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for a second server")
    parser.add_argument("--before", metavar="REV", help="also serve from this git commit (before/after)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds at each concurrency level")
    parser.add_argument("--skip-stages", action="store_true", help="only part 2")
    args = parser.parse_args()
    interpreter = memory()  # before the header's hardware lines import torch
    print_header("memory: a CPU server's resident set by start-up stage, and the server's own")
    if not args.skip_stages:
        startup_stages(args, interpreter)
    os.environ.pop("OMP_NUM_THREADS", None)
    server_process(args)


if __name__ == "__main__":
    main()
