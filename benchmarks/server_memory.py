"""Where a CPU server's memory goes: resident set after each stage of start-up, then the server's.

Part 1 builds, in this process and in the order `kvasir serve` does, each stage of a server of
`--model` (default: the embedded SmolLM2-135M Q4_1 GGUF) and prints the resident set (VmRSS), its
peak so far (VmHWM: transient peaks count), and its anonymous and file-backed parts after each:
the interpreter, `import torch`, the server's modules, the model's files (config, tokenizer),
the weights, the engine (KV cache), a warm-up, a batch of `--concurrency` streams. The KV cache's
own size is printed beside it (it is as resident as the pages it has touched).

Part 2 starts `kvasir serve` itself (same flags as the llama.cpp comparison: 512 KV blocks of 16
tokens, one thread) and reads its VmRSS/VmHWM from /proc when ready and after streamed load at
each concurrency level. `--env NAME=VALUE` runs a second server with that environment too
(alternating rounds), to weigh an allocator setting such as MALLOC_ARENA_MAX.

    python benchmarks/server_memory.py [--model embedded] [--concurrency 1 8 32] [--tokens 64]
        [--env MALLOC_ARENA_MAX=2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from gguf_vs_llama_cpp import KV_TOKENS, kvasir_server, measure, server

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


def server_process(args: argparse.Namespace) -> None:
    variants = {"as shipped": {}}
    for setting in args.env:
        name, _, value = setting.partition("=")
        variants[setting] = {name: value}
    rows: list[list[object]] = []
    for label, extra in variants.items():
        command, env, url, health = kvasir_server(args.model, args.threads)
        with server(command, {**env, **extra}, url, health) as pid:
            ready = memory(pid)
            rows.append([label, "ready", ready["VmRSS"], ready["VmHWM"]])
            for concurrency in args.concurrency:
                asyncio.run(measure(url, concurrency, args.tokens, 1))
                now = memory(pid)
                rows.append([label, f"after {concurrency} streams", now["VmRSS"], now["VmHWM"]])
    print("`kvasir serve` process (MiB):")
    print_table(["server", "when", "RSS", "peak RSS (VmHWM)"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for a second server")
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
