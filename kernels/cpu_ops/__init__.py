"""C kernels for the CPU, compiled on the machine that runs them and called through ctypes.

The source sits beside this file; the first use compiles it with the system C compiler
(`cc -O3 -march=native -fopenmp`, as Triton compiles its launchers) into a cache folder keyed by
the source, the flags and the CPU, so later processes load it at once. Without a compiler, or if
the build fails, `load_library` returns None (the reason is logged once) and callers run the torch
reference instead. `KVASIR_CPU_KERNELS=0` turns them off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("group_affine_gemm.c")
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


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built (the torch reference runs then)."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        logger.info("CPU C kernels off (%s=0): quantized matmuls run the torch reference", DISABLE_ENV)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler found: quantized matmuls on CPU run the torch reference")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = cache_dir() / f"group_affine_gemm-{key}.so"
    try:
        if not target.exists() and not _build(compiler, target):
            return None
        library = ctypes.CDLL(str(target))
    except OSError as error:  # an unwritable cache folder (set XDG_CACHE_HOME), or a bad library
        logger.warning("CPU kernels unavailable (%s): quantized matmuls run the torch reference", error)
        return None
    for name in ("group_affine_gemm_4bit_g32", "group_affine_gemm_8bit_g32", "group_affine_gemm_8bit_g16"):
        function = getattr(library, name)
        function.restype = None
        function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    library.group_affine_max_rows.restype = ctypes.c_int
    return library


def _build(compiler: str, target: Path) -> bool:
    """Compile the source into `target`; False (and a warning) if the compiler fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            logger.warning(
                "building the CPU kernels failed (%s): quantized matmuls run the torch reference",
                result.stderr.strip()[:500],
            )
            return False
        os.replace(built, target)  # atomic: concurrent processes never load a half-written file
    return True
