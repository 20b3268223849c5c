"""Where the ranks of one tensor-parallel group run: how many machines, which ranks on each.

`--tensor-parallel-size N --nnodes M` puts N/M ranks on each machine (node). Node 0 (the leader)
serves the API, runs the one scheduler and hosts the rendezvous on `--master-addr:--master-port`;
nodes 1..M-1 run `kvasir serve --headless`: only their ranks. Rank r lives on node r // (N/M) as
its local rank r % (N/M) (its GPU, cuda:<local rank>). Pure arithmetic; the config checks that M
divides N and that the node rank is in range, before anything starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvasir.runtime.config import EngineConfig

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class NodeLayout:
    """This machine's place in the group."""

    size: int  # --tensor-parallel-size: ranks over all nodes
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = LOOPBACK
    master_port: int = 0  # 0 on one node: the rendezvous takes any free loopback port

    @classmethod
    def of(cls, config: EngineConfig) -> NodeLayout:
        """The layout `config`'s flags describe (EngineConfig has checked them)."""
        multi = config.nnodes > 1
        return cls(
            size=config.tensor_parallel_size,
            nnodes=config.nnodes,
            node_rank=config.node_rank,
            master_addr=config.master_addr if multi else LOOPBACK,
            master_port=config.master_port if multi else 0,
        )

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.ranks_per_node

    @property
    def ranks(self) -> range:
        """The global ranks this node runs (node 0: rank 0, the serving process, among them)."""
        return self.ranks_of(self.node_rank)

    def ranks_of(self, node: int) -> range:
        """The global ranks node `node` runs."""
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def local_index(self, rank: int) -> int:
        """`rank`'s index on its node: its GPU is cuda:<this>."""
        return rank % self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def worker_nodes(self) -> range:
        """The nodes the leader drives over the network."""
        return range(1, self.nnodes)


def machine_kv_share(kv_per_token: Sequence[int], rank: int, nnodes: int) -> float:
    """Rank `rank`'s cut of the CPU KV budget (`--kv-cache-bytes`), which is each machine's, as
    vLLM's memory settings are each device's: the KV elements a token takes on this rank over
    those of every rank on its machine (`kv_per_token[r]`: rank r's, over all N ranks), so each
    cut buys the same number of blocks. 1.0 for a rank alone on its machine."""
    layout = NodeLayout(size=len(kv_per_token), nnodes=nnodes)
    machine = layout.ranks_of(layout.node_of(rank))
    return kv_per_token[rank] / sum(kv_per_token[other] for other in machine)
