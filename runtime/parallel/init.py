"""Joining the ranks into process groups: the one place that calls `init_process_group`.

Rank 0 (the serving process) hosts the rendezvous, a `TCPStore`: on one machine on a loopback
port the kernel picks (no port to configure, none to collide on); across machines (`--nnodes`) on
`--master-port`, every interface, where the other nodes' ranks reach it at `--master-addr`. Every
rank, rank 0 included, then joins with `join_group`. Two groups come out of it (see `group.py`): the device collectives' (NCCL on GPUs,
gloo on CPUs) and a gloo group that carries Python objects, so a step's plan never crosses NCCL.
The device group uses `timeout`: a collective that a peer never joins raises instead of waiting
forever (the CPU group's idle wait is bounded otherwise, see `join_group`).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from kvasir.runtime.parallel.group import TensorParallel
from kvasir.runtime.parallel.topology import LOOPBACK

IDLE_WAIT = datetime.timedelta(days=365)


def host_rendezvous(size: int, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """The store every rank meets at, served from this process (rank 0); `.port` is its port. The
    server listens on every interface; port 0: the kernel picks a free one. ValueError naming
    --master-port when it cannot listen (another process holds the port)."""
    try:
        return dist.TCPStore(
            LOOPBACK,  # where this process's own client connects
            port,
            world_size=size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,  # the other ranks are spawned after this returns
        )
    except dist.DistNetworkError as error:
        where = f"--master-port {port}" if port else "a loopback port"
        reason = str(error).splitlines()[0]
        raise ValueError(f"the ranks' rendezvous cannot listen on {where}: {reason}") from None


# Start-up is slower than any step: N interpreters import torch, then each loads its shard (minutes
# for a large model on slow storage). The groups' own timeout is therefore this bound at least;
# steps are bounded by --distributed-timeout-seconds through rank 0's watchdog.
STARTUP_TIMEOUT_S = 900.0


def startup_timeout(distributed_timeout_s: float) -> float:
    """The groups' timeout: the start-up bound, or the operator's when it is longer."""
    return max(distributed_timeout_s, STARTUP_TIMEOUT_S)


def backend_for(device_type: str) -> str:
    """The device collectives' backend: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


def join_group(
    rank: int,
    size: int,
    port: int,
    device_type: str,
    timeout_s: float,
    store: dist.Store | None = None,
    host: str = LOOPBACK,
    device_index: int | None = None,
) -> TensorParallel:
    """Join the ranks' groups as `rank` (rank 0 passes the store it hosts, the others reach it at
    `host:port`); returns this process's `TensorParallel`. On CUDA the rank uses
    cuda:`device_index` (its index on its own machine; default: `rank`, one machine)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size=size, is_master=False, timeout=timeout)
    backend = backend_for(device_type)
    if device_type == "cuda":
        torch.cuda.set_device(rank if device_index is None else device_index)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    # Every rank creates the groups in the same order (new_group is itself a collective). A rank
    # waits on the CPU group for rank 0's next call for as long as the server is idle, so that
    # group's timeout is unbounded in practice: rank 0's watchdog bounds every call instead, and
    # a rank whose rank 0 is gone exits on its pipe (engine/ranks/rank_main.py).
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(list(range(size)), backend="gloo", timeout=IDLE_WAIT)
    return TensorParallel(rank=rank, size=size, group=device_group, cpu_group=cpu_group)


def leave_group() -> None:
    """Tear this process's groups down (so an engine built later in the same process can join
    new ones); a no-op when none was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()
