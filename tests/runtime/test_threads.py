"""The CPU thread default: the whole CPUs the process may use (affinity and quota), at least one;
an explicit choice (--threads, then OMP_NUM_THREADS) wins, and the choice is set and logged."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

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


def test_short_spin_wait_is_a_default_the_user_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(threads.SPIN_ENV, raising=False)
    monkeypatch.delenv(threads.WAIT_POLICY_ENV, raising=False)
    threads.short_spin_wait()
    assert os.environ[threads.SPIN_ENV] == str(threads.SHORT_SPIN)
    monkeypatch.setenv(threads.SPIN_ENV, "300000")
    threads.short_spin_wait()
    assert os.environ[threads.SPIN_ENV] == "300000"
    monkeypatch.delenv(threads.SPIN_ENV)
    monkeypatch.setenv(threads.WAIT_POLICY_ENV, "ACTIVE")
    threads.short_spin_wait()
    assert threads.SPIN_ENV not in os.environ


def test_the_cli_sets_the_spin_before_torch_loads() -> None:
    # libgomp reads GOMP_SPINCOUNT once, when torch loads it: `kvasir serve` and `generate` must
    # set it before anything imports torch. Building the CLI's parser imports every subcommand.
    code = (
        "import os, sys, kvasir.cli as cli; cli.build_parser(); "
        "assert 'torch' not in sys.modules, 'the CLI imported torch before its handlers ran'; "
        "assert os.environ['GOMP_SPINCOUNT'] == '1000', os.environ.get('GOMP_SPINCOUNT')"
    )
    env = {k: v for k, v in os.environ.items() if k not in (threads.SPIN_ENV, threads.WAIT_POLICY_ENV)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
