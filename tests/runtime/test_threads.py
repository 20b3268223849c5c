"""The CPU thread default: the whole CPUs the process may use (affinity and quota), at least one;
an explicit choice (--threads, then OMP_NUM_THREADS) wins, and the choice is set and logged."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kvasir.runtime import threads


@pytest.mark.parametrize("cpus, expected", [(1, 1), (1.5, 1), (2, 2), (4, 4), (2.9, 2), (64, 64), (0.5, 1)])
def test_default_takes_the_whole_usable_cpus_and_keeps_one(cpus: float, expected: int) -> None:
    assert threads.default_threads(cpus) == expected


def test_the_cgroup_quota_caps_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "_cgroup_quota", lambda: 2.0)
    assert threads.available_cpus() == min(2.0, len(os.sched_getaffinity(0)))
    monkeypatch.setattr(threads, "_cgroup_quota", lambda: None)
    assert threads.available_cpus() == len(os.sched_getaffinity(0))


def test_explicit_choices_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.choose_threads(5) == (5, "--threads or KVASIR_THREADS")
    assert threads.choose_threads(None) == (3, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    count, why = threads.choose_threads(None)
    assert count == threads.default_threads(threads.available_cpus()) and "CPUs usable" in why


def test_apply_sets_torch_and_logs(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="kvasir.runtime.threads"):
            assert threads.apply_threads(1) == 1
        assert torch.get_num_threads() == 1
        assert "CPU threads: 1 (--threads or KVASIR_THREADS" in caplog.text
    finally:
        torch.set_num_threads(before)
