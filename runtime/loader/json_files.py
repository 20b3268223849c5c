"""Reading a checkpoint's JSON files, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvasir.runtime.loader.errors import ModelLoadError


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; a missing, unreadable or non-object file is a ModelLoadError."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise ModelLoadError(f"{path}: file not found") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})") from error
    except OSError as error:
        raise ModelLoadError(f"{path}: cannot be read ({error})") from error
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def read_optional_json_object(path: Path) -> dict[str, Any]:
    """Like `read_json_object`, but a file that does not exist reads as `{}`."""
    return read_json_object(path) if path.exists() else {}
