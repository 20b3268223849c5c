"""What `kvasir render -f` reads, as `kubectl apply -f` does: files, `-` for stdin, directories
(their .yaml, .yml and .json files, sorted; with -R their subdirectories' too) and glob patterns
(quoted, or already expanded by the shell into several names after one -f)."""

from __future__ import annotations

import glob
import sys
from collections.abc import Iterable
from pathlib import Path

from kvasir.operator.yaml_input import (
    MAX_INPUT_BYTES,
    Document,
    InputError,
    decode,
    load_documents,
    read_input,
)

EXTENSIONS = (".yaml", ".yml", ".json")


def expand(arguments: Iterable[str], *, recursive: bool = False) -> list[str]:
    """The files to read, in order; InputError, naming the argument, for one that names none."""
    found: list[str] = []
    for argument in arguments:
        if argument == "-":
            found.append(argument)
        elif Path(argument).is_dir():
            found += _directory(argument, recursive)
        elif Path(argument).exists():
            found.append(argument)
        elif glob.has_magic(argument):
            matches = sorted(glob.glob(argument, recursive=recursive))
            if not matches:
                raise InputError(f"{argument}: matches no files")
            for match in matches:
                found += _directory(match, recursive) if Path(match).is_dir() else [match]
        else:
            raise InputError(f"{argument}: no such file or directory")
    return found


def _directory(path: str, recursive: bool) -> list[str]:
    pattern = "**/*" if recursive else "*"
    files = sorted(str(p) for p in Path(path).glob(pattern) if p.suffix in EXTENSIONS and p.is_file())
    if not files:
        raise InputError(f"{path}: a directory with no .yaml, .yml or .json files")
    return files


def read_documents(name: str) -> list[Document]:
    """The documents of one input (`-`: stdin); InputError (with the line, not the name) if it
    cannot be read, is larger than MAX_INPUT_BYTES, or is not data."""
    if name == "-":
        stream = sys.stdin
        if hasattr(stream, "buffer"):
            text = decode(read_input(stream.buffer))
        else:  # a text stream (tests replace stdin so)
            text = stream.read(MAX_INPUT_BYTES + 1)
            if len(text) > MAX_INPUT_BYTES:
                raise InputError(f"larger than {MAX_INPUT_BYTES >> 20} MiB: too large to read")
    else:
        text = decode(read_input(name))
    return load_documents(text, json_file=name.endswith(".json"))
