# Imported before any test module or conftest imports torch: the runtime's OpenMP spin default
# (kvasir/runtime/threads.py) then applies to the tests' own engines as it does to `kvasir serve`.
import kvasir.runtime  # noqa: F401
