"""Helpers the serving benchmarks share: a `kvasir serve` subprocess, and the model's tokenizer on disk.

Not a benchmark itself. The server runs as its own process (as in production), so the load
generator and the server do not share an interpreter; on a small machine they do share the cores,
and the results say so.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType

READY_TIMEOUT_S = 300.0


class ServerProcess:
    """`kvasir serve ARGS` on 127.0.0.1 and a free port; `url` once ready; SIGTERM (drain) on exit."""

    def __init__(self, *args: str) -> None:
        self.command = [
            sys.executable, "-m", "kvasir.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args,
        ]  # fmt: skip
        self.url = ""
        self._lines: queue.Queue[str] = queue.Queue()
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        self._process = subprocess.Popen(
            self.command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
        )
        threading.Thread(target=self._read, daemon=True).start()
        self.url = "http://" + self._wait_for(r"Uvicorn running on http://([\d.]+:\d+)").group(1)
        self._wait_for(r"ready: serving")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(60)

    def _read(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        for line in self._process.stderr:
            self._lines.put(line)

    def _wait_for(self, pattern: str) -> re.Match[str]:
        regex = re.compile(pattern)
        seen = []
        while True:
            try:
                line = self._lines.get(timeout=READY_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"server did not log {pattern!r}:\n" + "".join(seen)) from None
            seen.append(line)
            match = regex.search(line)
            if match:
                return match


def export_tokenizer(model: str, folder: Path) -> Path:
    """Write the model's tokenizer (GGUF or HF) as a Hugging Face folder a load generator can load offline."""
    from kvasir.runtime.engine_args import EMBEDDED_MODEL
    from kvasir.runtime.loader.embedded import embedded_model_path
    from kvasir.runtime.loader.model_files import open_local_model

    path = embedded_model_path() if model == EMBEDDED_MODEL else Path(model)
    tokenizer = open_local_model(path).tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "chat_template": tokenizer.chat_template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
