"""Serving latency and throughput measured by guidellm (a load generator no one here wrote).

Starts `kvasir serve` (default: the embedded SmolLM2-135M-Instruct) in a subprocess, writes the
model's own tokenizer as a Hugging Face folder so guidellm runs offline (`HF_HUB_OFFLINE=1`), and
runs guidellm's `concurrent` profile at each `--concurrency` level with synthetic prompts of
`--prompt-tokens` and `--output-tokens` (EOS ignored, streamed). Reported per level, from
guidellm's JSON report: TTFT and ITL p50/p99, requests/s and output tokens/s (completed requests
over the benchmark's duration). Needs the `bench` extra: `pip install -e '.[bench]'`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from serving_server import ServerProcess, export_tokenizer


def scenario(
    url: str, model: str, tokenizer: Path, streams: int, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """A guidellm scenario: one concurrent benchmark of `streams` streams, `requests_per_stream` each."""
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": model,
                "request_format": "/v1/completions",
            },
            "profile": {"kind": "concurrent", "streams": streams},
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens,
                }
            ],
            "seed": {"kind": "static", "value": 42},
            "constraints": [{"kind": "max_requests", "count": streams * args.requests_per_stream}],
            "outputs": [{"kind": "json", "path": str(out)}],
        }
    }


def summarize(report: dict[str, Any]) -> dict[str, float]:
    benchmark = report["benchmarks"][0]
    metrics = benchmark["metrics"]

    def pct(name: str, p: str) -> float:
        return float(metrics[name]["successful"]["percentiles"][p])

    duration = float(benchmark["duration"])
    completed = float(metrics["request_latency"]["successful"]["count"])
    output_tokens = float(metrics["output_token_count"]["successful"]["total_sum"])
    errored = float(metrics["request_latency"]["errored"]["count"])
    return {
        "ttft_p50": pct("time_to_first_token_ms", "p50"),
        "ttft_p99": pct("time_to_first_token_ms", "p99"),
        "itl_p50": pct("inter_token_latency_ms", "p50"),
        "itl_p99": pct("inter_token_latency_ms", "p99"),
        "requests_per_s": completed / duration,
        "output_tokens_per_s": output_tokens / duration,
        "completed": completed,
        "errored": errored,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated stream counts")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args(argv)
    guidellm = shutil.which("guidellm")
    if guidellm is None:
        sys.exit("guidellm is not installed: pip install -e '.[bench]'")
    print_header("serving: guidellm against kvasir serve", argv)
    version = subprocess.run([guidellm, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"load generator: {version}")

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        tokenizer = export_tokenizer(args.model, work / "tokenizer")
        with ServerProcess("--model", args.model, "--max-model-len", str(args.max_model_len)) as server:
            import httpx

            model = httpx.get(server.url + "/v1/models", timeout=60).json()["data"][0]["id"]
            for streams in (int(level) for level in args.concurrency.split(",")):
                out = work / f"guidellm-{streams}.json"
                config = work / f"scenario-{streams}.json"
                config.write_text(json.dumps(scenario(server.url, model, tokenizer, streams, args, out)))
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
                subprocess.run(
                    [guidellm, "run", "--scenario", str(config), "--disable-console"],
                    check=True,
                    env=env,
                    cwd=work,
                    stdout=subprocess.DEVNULL,
                )
                result = summarize(json.loads(out.read_text()))
                rows.append(
                    [
                        streams,
                        int(result["completed"]),
                        int(result["errored"]),
                        result["ttft_p50"],
                        result["ttft_p99"],
                        result["itl_p50"],
                        result["itl_p99"],
                        result["requests_per_s"],
                        result["output_tokens_per_s"],
                    ]
                )
    print(
        f"workload: synthetic prompts of {args.prompt_tokens} tokens, {args.output_tokens} output tokens "
        f"(EOS ignored), streamed /v1/completions; {args.requests_per_stream} requests per stream"
    )
    print_table(
        [
            "concurrency",
            "completed",
            "errors",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "ITL p50 ms",
            "ITL p99 ms",
            "req/s",
            "output tok/s",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
