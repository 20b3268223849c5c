"""C kernels for the CPU, compiled on the machine that runs them and called through ctypes.

Each source (`<name>.c`) sits beside this file (one may `#include` another, as
`decoder_stack.c` does); the first `load_library(name)` compiles it with the
system C compiler (`cc -O3 -march=native -fopenmp`, as Triton compiles its launchers) into a cache
folder keyed by the source, the flags and the CPU, so later processes load it at once. The wrapper
module that calls a library declares its functions' signatures (`Signatures`). Without a compiler,
or if the build fails, `load_library` returns None (the reason is logged once) and callers run the
torch reference instead. `KVASIR_CPU_KERNELS=0` turns them all off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).parent
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DISABLE_ENV = "KVASIR_CPU_KERNELS"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvasir" / "cpu_kernels"


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


# function name -> (restype, argtypes), as ctypes takes them.
Signatures = Mapping[str, tuple[Any, Sequence[Any]]]


# Each source's library (None where it could not be built), loaded once per process.
_loaded: dict[str, ctypes.CDLL | None] = {}


def load_library(name: str, signatures: Signatures) -> ctypes.CDLL | None:
    """`<name>.c` compiled, its functions typed; None where it cannot be built (callers fall back)."""
    # Wrappers call this on every op: after the first call, one dict lookup.
    if name not in _loaded:
        _loaded[name] = _load(name, signatures)
    return _loaded[name]


# The words a boolean KVASIR_* variable may hold (kvasir.runtime.settings.BOOL_WORDS: the kernels
# import nothing of the runtime).
_BOOL_WORDS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def enabled() -> bool:
    """False where `KVASIR_CPU_KERNELS` turns the C kernels off; ValueError naming the variable for
    a value that is not a boolean word (`kvasir serve` and the model runner check it at start-up)."""
    value = os.environ.get(DISABLE_ENV, "1")
    word = value.strip().lower()
    if word not in _BOOL_WORDS:
        raise ValueError(f"{DISABLE_ENV} must be one of 1/0/true/false/yes/no/on/off, got {value!r}")
    return _BOOL_WORDS[word]


def _load(name: str, signatures: Signatures) -> ctypes.CDLL | None:
    if not enabled():
        logger.info("CPU C kernels off (%s=0): quantized matmuls run the torch reference", DISABLE_ENV)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler found: quantized matmuls on CPU run the torch reference")
        return None
    source = SOURCES / f"{name}.c"
    key = hashlib.sha256(
        _source_text(source) + " ".join(FLAGS).encode() + _cpu_signature().encode()
    ).hexdigest()
    target = cache_dir() / f"{name}-{key[:16]}.so"
    try:
        if not target.exists() and not _build(compiler, source, target):
            return None
        library = ctypes.CDLL(str(target))
    except OSError as error:  # an unwritable cache folder (set XDG_CACHE_HOME), or a bad library
        logger.warning("CPU kernels unavailable (%s): quantized matmuls run the torch reference", error)
        return None
    for function_name, (restype, argtypes) in signatures.items():
        function = getattr(library, function_name)
        function.restype = restype
        function.argtypes = list(argtypes)
    return library


_INCLUDE = re.compile(rb'^#include "([^"]+)"', re.MULTILINE)


def _source_text(source: Path) -> bytes:
    """The source and, after it, every file it includes with `#include "..."` (recursively): a
    change to an included kernel must rebuild the libraries that include it."""
    text = source.read_bytes()
    return text + b"".join(_source_text(source.parent / name.decode()) for name in _INCLUDE.findall(text))


def clear_cache() -> None:
    """Forget the loaded libraries (tests that change the environment load them again)."""
    _loaded.clear()


def _build(compiler: str, source: Path, target: Path) -> bool:
    """Compile the source into `target`; False (and a warning) if the compiler fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(built)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            logger.warning(
                "building the CPU kernels failed (%s): quantized matmuls run the torch reference",
                result.stderr.strip()[:500],
            )
            return False
        os.replace(built, target)  # atomic: concurrent processes never load a half-written file
    return True
