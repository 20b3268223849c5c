"""Real-model CPU throughput of two versions of the runtime: the Kvasir side of
continuous_vs_static.py, run from an older commit and from this checkout, alternating.

    python benchmarks/compare_checkouts.py 3037173            # that commit vs the working tree
    python benchmarks/compare_checkouts.py 3037173 --rounds 3

The older commit is checked out into a temporary git worktree. Each run is a fresh process whose
`kvasir` package is the checkout's own (a tree of links to its top-level folders, first on
sys.path), using that checkout's benchmarks/continuous_vs_static.py with its default workload and
the engine's CPU defaults. Both sides run the same checkpoint, written once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cli", "runtime", "operator", "kernels", "simulator", "observability")

# Runs inside the child: the checkout's package and benchmark, the Kvasir side only.
CHILD = """
import json, sys
from pathlib import Path
checkout, packages, model = (Path(a) for a in sys.argv[1:4])
sys.path[:0] = [str(packages), str(checkout / "benchmarks")]
import torch
import kvasir.runtime
assert Path(kvasir.runtime.__file__).resolve().is_relative_to(checkout.resolve()), kvasir.runtime.__file__
import continuous_vs_static as bench
args = bench.parse_args([])
torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)
spec = bench.TinyLlamaSpec(
    hidden_size=args.hidden_size, intermediate_size=args.intermediate_size, num_layers=args.num_layers,
    num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, vocab_size=args.vocab_size,
    max_position_embeddings=max(2048, args.max_prompt + args.max_output), seed=args.seed,
)
workload = bench.make_workload(args, spec.vocab_size)
if not (model / "config.json").exists():
    bench.build_random_llama(model, spec)
timing, _, _ = bench.run_continuous(model, workload, args)
print(json.dumps({"wall_s": timing.wall_s, "cpu_s": timing.cpu_s, "tokens": workload.output_tokens}))
"""


def package_tree(checkout: Path, target: Path) -> Path:
    """A folder whose `kvasir/<name>` entries link to the checkout's top-level package folders."""
    (target / "kvasir").mkdir(parents=True)
    for name in PACKAGES:
        if (checkout / name).is_dir():
            (target / "kvasir" / name).symlink_to(checkout / name)
    return target


def run_once(checkout: Path, packages: Path, model: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(checkout), str(packages), str(model)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the older commit (anything git rev-parse accepts)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per side")
    args = parser.parse_args()
    print_header("Kvasir continuous batching, two checkouts", sys.argv)
    with tempfile.TemporaryDirectory(prefix="kvasir-checkouts-") as tmp:
        old = Path(tmp) / "old"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.revision], check=True
        )
        try:
            sides = {
                f"{args.revision} (before)": (old, package_tree(old, Path(tmp) / "old-packages")),
                "this checkout (after)": (ROOT, package_tree(ROOT, Path(tmp) / "new-packages")),
            }
            model = Path(tmp) / "model"
            results: dict[str, list[dict[str, float]]] = {label: [] for label in sides}
            for round_index in range(args.rounds):
                for label, (checkout, packages) in sides.items():
                    result = run_once(checkout, packages, model)
                    results[label].append(result)
                    print(f"round {round_index + 1}: {label} {result['wall_s']:.1f}s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    rows = []
    medians = []
    for label, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        medians.append(wall)
        rows.append([label, wall, cpu, runs[0]["tokens"] / wall])
    print()
    print_table(["checkout", "median wall s", "median CPU s", "output tok/s (wall)"], rows)
    print(f"\nafter / before throughput (wall): {medians[0] / medians[1]:.3f}")


if __name__ == "__main__":
    main()
