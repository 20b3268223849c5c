"""`--kv-cache-bytes` on the CPU is each machine's budget (vLLM's memory settings are each
device's): the tensor-parallel ranks on one machine share it, cut by the KV bytes a token takes on
each, and a machine of `--nnodes` never gives part of its budget to another's ranks."""

from __future__ import annotations

import pytest

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.parallel.topology import NodeLayout, machine_kv_share


def test_one_machine_cuts_its_budget_by_each_ranks_kv_heads() -> None:
    # The embedded model's 3 KV heads over two ranks: 1 and 2.
    assert [machine_kv_share([1, 2], rank, nnodes=1) for rank in range(2)] == pytest.approx([1 / 3, 2 / 3])
    assert [machine_kv_share([4] * 4, rank, nnodes=1) for rank in range(4)] == [0.25] * 4


def test_each_machine_of_a_group_has_the_whole_budget() -> None:
    # Two machines of one rank each: each rank has its machine's whole budget (was half).
    assert [machine_kv_share([1, 2], rank, nnodes=2) for rank in range(2)] == [1.0, 1.0]
    # Four ranks on two machines: ranks 0-1 share machine 0, ranks 2-3 machine 1.
    shares = [machine_kv_share([1, 3, 2, 2], rank, nnodes=2) for rank in range(4)]
    assert shares == pytest.approx([1 / 4, 3 / 4, 1 / 2, 1 / 2])
    assert list(NodeLayout(size=4, nnodes=2).ranks_of(1)) == [2, 3]


def test_the_flag_says_the_budget_is_each_machines() -> None:
    flag = EngineConfig.__dataclass_fields__["kv_cache_bytes"].metadata["flag"]
    assert "each machine's" in flag.help
