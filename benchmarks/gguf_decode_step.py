"""Offline single-stream decode step of the embedded SmolLM2-135M GGUF (`LLMEngine`, one thread):
an older commit against this checkout with each CPU activation setting, alternating, in one run.

    python benchmarks/gguf_decode_step.py                 # 7544fd6 (the kernel before tiling)
    python benchmarks/gguf_decode_step.py --baseline HEAD~2 --rounds 3 --tokens 64

Each side is a fresh process (the older commit from a temporary git worktree, as
compare_checkouts.py runs it) that loads the model and, after a warm-up, times one greedy request
(the README's chat prompt) twice: with 1 and with 1 + `--tokens` new tokens. The difference over
`--tokens` is the decode step, in process CPU time (the machine is shared; descheduling does not
count) and wall time. This checkout runs once per `KVASIR_GGUF_CPU_ACTIVATIONS` setting. The
answers' text is printed too, so a change of output shows next to the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from compare_checkouts import ROOT, package_tree

SETTINGS = ("float", "int16", "int8")

CHILD = """
import json, os, sys, time
from pathlib import Path
checkout, packages, tokens = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, str(packages))
import torch
torch.set_num_threads(1)
import kvasir.runtime
assert Path(kvasir.runtime.__file__).resolve().is_relative_to(checkout.resolve()), kvasir.runtime.__file__
from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.sample.params import SamplingParams
engine = LLMEngine(EngineConfig(model=str(embedded_model_path()), device="cpu", dtype="float32"))
tokenizer = engine.tokenizer
messages = [{"role": "user", "content": "What is the capital of France?"}]
prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
def run(n):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    cpu, wall = time.process_time(), time.perf_counter()
    result = engine.generate([prompt], params)[0]
    return time.process_time() - cpu, time.perf_counter() - wall, result.choices[0].text
run(8)
first_cpu, first_wall, _ = run(1)
cpu, wall, text = run(1 + tokens)
print(json.dumps({"step_cpu_ms": (cpu - first_cpu) * 1e3 / tokens, "step_wall_ms": (wall - first_wall) * 1e3 / tokens,
                  "text": text}))
"""


def run_side(checkout: Path, packages: Path, tokens: int, setting: str | None) -> dict[str, object]:
    env = dict(os.environ, KVASIR_THREADS="1")
    if setting is not None:
        env["KVASIR_GGUF_CPU_ACTIVATIONS"] = setting
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(checkout), str(packages), str(tokens)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", default="7544fd6", help="the older commit")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print_header("GGUF decode step, embedded SmolLM2-135M, one thread", sys.argv)
    with tempfile.TemporaryDirectory(prefix="kvasir-step-") as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.baseline],
                       check=True, capture_output=True)  # fmt: skip
        try:
            sides: dict[str, tuple[Path, Path, str | None]] = {
                f"{args.baseline} (before)": (old, package_tree(old, Path(tmp) / "old-packages"), None)
            }
            new_packages = package_tree(ROOT, Path(tmp) / "new-packages")
            for setting in SETTINGS:
                sides[f"this checkout, {setting}"] = (ROOT, new_packages, setting)
            results: dict[str, list[dict[str, object]]] = {label: [] for label in sides}
            for round_index in range(args.rounds):
                for label, (checkout, packages, setting) in sides.items():
                    result = run_side(checkout, packages, args.tokens, setting)
                    results[label].append(result)
                    print(
                        f"round {round_index + 1}: {label}: {float(result['step_cpu_ms']):.2f} ms CPU",
                        flush=True,
                    )
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    baseline = statistics.median(float(r["step_cpu_ms"]) for r in next(iter(results.values())))
    rows = []
    for label, runs in results.items():
        cpu = statistics.median(float(r["step_cpu_ms"]) for r in runs)
        wall = statistics.median(float(r["step_wall_ms"]) for r in runs)
        rows.append([label, cpu, wall, baseline / cpu])
    print()
    print_table(["side", "decode step, ms CPU", "ms wall", "speedup (CPU)"], rows)
    print()
    for label, runs in results.items():
        print(f"{label}: {str(runs[0]['text'])[:100]!r}")


if __name__ == "__main__":
    main()
