"""`kvasir generate` on a model whose files lie or hold something hostile: exit status 2 and one
`kvasir generate: ...` line naming the problem, no traceback, and no gigabytes on the way.

The cases run one after another in one fresh interpreter (torch imported before the baseline), which
reports each exit status and stderr and how far its peak memory grew. Only a generous hang guard
bounds the time: the bounds are counts and sizes, never seconds."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType

from tests.gguf_encode import encode
from tests.runtime.loader.tiny_gguf import (
    Q,
    field,
    gguf_bytes,
    gguf_string,
    nested_array,
    tiny_tensors,
    write_tiny_gguf,
)

CHILD = textwrap.dedent(
    """
    import contextlib, io, json, sys

    def peak():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    import torch  # noqa: F401 - imported before the baseline, as every case needs it
    import kvasir.runtime.engine.llm_engine  # noqa: F401
    from kvasir.cli import main

    torch.set_num_threads(1)
    cases = json.loads(sys.argv[1])
    before = peak()
    results = {}
    for name, argv in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        results[name] = {"code": code, "stderr": err.getvalue()}
    print(json.dumps({"results": results, "growth": peak() - before}))
    """
)

# What each refusal names.
EXPECTED = {
    "gguf 1,000,000 layers": r"llama\.block_count is 1,000,000, but the checkpoint holds tensors for 2 layers",
    "config.json 1,000,000 layers": r"num_hidden_layers is 1,000,000, but the checkpoint holds tensors for 2 layers",
    "context length 2**28": r"one sequence of 268,435,456 tokens \(the model's context length\) needs",
    "hanging chat template": r"the chat template cannot render a one-message chat: .*render step limit",
    "zero heads": r"llama\.attention\.head_count is 0: must be a positive integer",
    "nested metadata": r"nests arrays more than 4 deep",
    "NaN scale": r"tensor 'blk\.1\.ffn_down\.weight' \(Q8_0\) has a NaN or infinite scale",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[..., Path]) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile")
    hf = shutil.copytree(tiny_checkpoint("llama"), folder / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))
    nested = folder / "nested.gguf"
    architecture = field("general.architecture", GGUFValueType.STRING, gguf_string("llama"))
    nested.write_bytes(gguf_bytes([architecture, field("x", GGUFValueType.ARRAY, nested_array(5000))]))
    tensors = {
        name: encode(values, Q.Q8_0) if values.ndim == 2 else values
        for name, values in tiny_tensors().items()
    }
    tensors["blk.1.ffn_down.weight"].reshape(-1, 34)[3, 0:2] = np.array([np.nan], dtype=np.float16).view(
        np.uint8
    )
    hanging = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    return {
        "gguf 1,000,000 layers": write_tiny_gguf(
            folder / "layers.gguf", meta={"llama.block_count": 1_000_000}
        ),
        "config.json 1,000,000 layers": hf,
        "context length 2**28": write_tiny_gguf(
            folder / "context.gguf", meta={"llama.context_length": 2**28}
        ),
        "hanging chat template": write_tiny_gguf(
            folder / "template.gguf", meta={"tokenizer.chat_template": hanging}
        ),
        "zero heads": write_tiny_gguf(folder / "heads.gguf", meta={"llama.attention.head_count": 0}),
        "nested metadata": nested,
        "NaN scale": write_tiny_gguf(folder / "nan.gguf", tensors=tensors, matrix_type=Q.Q8_0),
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_generate_refuses_each_with_one_line_and_exit_2(models: dict[str, Path], tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "hello", "max_tokens": 2}\n')
    cases = {
        name: ["generate", "--model", str(path), "--device", "cpu", "--input", str(source)]
        for name, path in models.items()
    }
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only: the cases take seconds
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name, expected in EXPECTED.items():
        result = report["results"][name]
        errors = [line for line in result["stderr"].splitlines() if line.startswith("kvasir generate:")]
        assert result["code"] == 2, (name, result["stderr"][-2000:])
        assert "Traceback" not in result["stderr"], name
        assert len(errors) == 1, (name, result["stderr"][-2000:])
        assert re.search(expected, errors[0]), (name, errors[0])
    # Each case stops before allocating what its files claim (a million layers, a 2**28-position
    # table); all of them together grew the peak by the tiny model and the tokenizer at most.
    assert report["growth"] < 300 * 2**20, f"peak grew by {report['growth'] / 2**20:.0f} MiB"
