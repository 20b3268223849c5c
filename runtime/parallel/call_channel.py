"""Rank 0's calls to the other ranks, one gloo broadcast each.

`TensorParallel.broadcast_object` (torch's `broadcast_object_list`) broadcasts twice per object,
its size and then its bytes, and each gloo broadcast waits for the receivers: measured between two
processes on a 2-core machine, 974 us per object against 241 us for one broadcast of a fixed 64 KiB
buffer (benchmarks/tensor_parallel_calls.py has the engine-level figures). A decode step's call is
a few hundred bytes to a few KiB, so here the pickled call travels inside a fixed buffer, with its
length in the first 8 bytes: one broadcast per call. A call larger than the buffer (a prefill of
many new long prompts) sends its bytes in a second broadcast, sized by the first.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvasir.runtime.parallel.group import TensorParallel

CALL_BUFFER_BYTES = 64 * 1024
_LENGTH = np.dtype("<u8")


class CallChannel:
    """Broadcasts pickled objects from rank 0 over the CPU (gloo) group; one per group."""

    def __init__(self, parallel: TensorParallel, capacity: int = CALL_BUFFER_BYTES) -> None:
        self._parallel = parallel
        self._buffer = torch.zeros(capacity, dtype=torch.uint8)
        self._bytes = self._buffer.numpy()  # the same memory, written without torch's overhead
        self._inline = capacity - _LENGTH.itemsize

    def send(self, obj: Any) -> None:
        """Rank 0: every other rank's `receive()` returns `obj`."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._bytes[: _LENGTH.itemsize].view(_LENGTH)[0] = len(data)
        if len(data) <= self._inline:
            self._bytes[_LENGTH.itemsize : _LENGTH.itemsize + len(data)] = np.frombuffer(data, np.uint8)
            self._broadcast(self._buffer)
            return
        self._broadcast(self._buffer)
        self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def receive(self) -> Any:
        """Ranks 1..N-1: the next object rank 0 sends (blocks until it does)."""
        self._broadcast(self._buffer)
        length = int(self._bytes[: _LENGTH.itemsize].view(_LENGTH)[0])
        if length <= self._inline:
            return pickle.loads(self._bytes[_LENGTH.itemsize : _LENGTH.itemsize + length].data)
        data = torch.empty(length, dtype=torch.uint8)
        self._broadcast(data)
        return pickle.loads(data.numpy().data)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0, group=self._parallel.cpu_group)
