"""Building rank 0's runner for `--tensor-parallel-size N`: check, spawn, join, load, wait.

Order matters. The model is checked against N before anything starts (a clear one-line error).
The other ranks are spawned before rank 0 loads its own shard, so all N load at once (and any
collective the runner makes while it is built finds its peers). Rank 0 answers only once every
rank has reported its runner built. With `--nnodes M` this process is node 0: it spawns only its
own N/M - 1 ranks, hosts the rendezvous on `--master-port` for the other nodes' ranks, and waits
for every node's agent to report each stage too (`parallel/node_link.py`).
"""

from __future__ import annotations

import logging

import torch

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.ranks.driver import MirroredRunner
from kvasir.runtime.engine.ranks.supervisor import STAGES, RankGroup
from kvasir.runtime.loader.model_files import ModelFiles
from kvasir.runtime.parallel.init import host_rendezvous, join_group, leave_group, startup_timeout
from kvasir.runtime.parallel.node_link import WorkerNodes, store_client
from kvasir.runtime.parallel.startup_check import check_tensor_parallel
from kvasir.runtime.parallel.topology import LOOPBACK, NodeLayout
from kvasir.runtime.startup_phases import StartupPhases
from kvasir.runtime.structured.stats import StructuredStats
from kvasir.runtime.threads import set_torch_threads, torch_threads
from kvasir.runtime.worker.model_runner import resolve_device

logger = logging.getLogger(__name__)


def threads_per_rank(threads: int, size: int) -> int:
    """Each rank's share of this process's CPU threads: the ranks run their steps at the same
    time, so N ranks of `threads` each would oversubscribe the cores N times."""
    return max(1, threads // size)


def start_ranks(
    config: EngineConfig,
    files: ModelFiles,
    phases: StartupPhases | None = None,
    structured_stats: StructuredStats | None = None,
) -> MirroredRunner:
    """Rank 0's runner, with ranks 1..N-1 running and ready; ValueError for a model or machine N
    does not fit, RankFailure when a rank fails to start."""
    size = config.tensor_parallel_size
    layout = NodeLayout.of(config)
    device = resolve_device(config.device)
    cuda_devices = torch.cuda.device_count() if device.type == "cuda" else 0
    check_tensor_parallel(files.config, size, device.type, cuda_devices, layout.nnodes)
    threads = threads_per_rank(torch_threads(), layout.ranks_per_node)
    set_torch_threads(threads)
    timeout = startup_timeout(config.distributed_timeout_seconds)
    store = host_rendezvous(size, timeout, layout.master_port)
    nodes = None
    if layout.multi_node:
        # A connection of the monitor's own to the store this process serves.
        nodes = WorkerNodes(store_client(LOOPBACK, store.port, timeout), layout.worker_nodes, STAGES)
    ranks = RankGroup(
        size, store, config, threads, config.distributed_timeout_seconds, layout=layout, nodes=nodes
    )
    logger.info(
        "tensor parallel: %d ranks (%s), rank pids %s, %d CPU threads each",
        size,
        "NCCL + gloo" if device.type == "cuda" else "gloo",
        ranks.pids,
        threads,
    )
    if layout.multi_node:
        logger.info(
            "tensor parallel over %d nodes, %d ranks each: waiting for nodes %s at port %d",
            layout.nnodes,
            layout.ranks_per_node,
            list(layout.worker_nodes),
            store.port,
        )
    try:
        # Joined only once every rank is about to: a rank that dies while it starts is then a
        # failure at once, not a rendezvous waiting out its timeout.
        ranks.wait_for("joining", timeout)
        parallel = join_group(0, size, store.port, device.type, timeout, store=store)
        runner = MirroredRunner(config, files, phases, structured_stats, parallel, ranks)
        ranks.wait_for("ready", timeout)
    except BaseException:
        ranks.fail("rank 0 could not start")
        ranks.close()
        leave_group()
        raise
    return runner
