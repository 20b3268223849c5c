"""Triton kernels and their launch wrappers; imported lazily by the dispatchers in `kvasir.kernels`."""
