"""The engine's CPU thread tuner: probes the other thread count now and then, keeps it only where
steps of the same size ran clearly faster, and only when nobody chose the count."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvasir.runtime import threads
from kvasir.runtime.thread_tuner import ThreadTuner


class Machine:
    """Step times per thread count that the test changes as the 'load' changes."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds
        self.applied: list[int] = []

    def run(self, tuner: ThreadTuner, steps: int, tokens: int = 8) -> None:
        for _ in range(steps):
            tuner.observe(tokens, self.seconds[tuner.threads()])


def test_keeps_the_default_where_it_is_faster() -> None:
    machine = Machine({2: 0.010, 1: 0.013})  # quiet: two threads 1.3x faster
    tuner = ThreadTuner((2, 1), machine.applied.append, exploit_steps=20, probe_steps=4)
    machine.run(tuner, 20)
    assert tuner.threads() == 1 and machine.applied == [1]  # the probe started
    machine.run(tuner, 4)
    assert tuner.threads() == 2 and machine.applied == [1, 2]  # and ended: back to two
    machine.run(tuner, 200)
    assert machine.applied.count(2) == machine.applied.count(1)  # every probe ended back on two


def test_switches_when_the_other_count_is_clearly_faster_and_back_when_it_no_longer_is() -> None:
    machine = Machine({2: 0.030, 1: 0.012})  # a busy neighbour: one thread 2.5x faster
    tuner = ThreadTuner((2, 1), machine.applied.append, exploit_steps=20, probe_steps=4)
    machine.run(tuner, 24)
    assert tuner.threads() == 1  # kept after the first probe
    machine.run(tuner, 200)
    assert tuner.threads() == 1
    machine.seconds = {2: 0.010, 1: 0.012}  # the neighbour left
    machine.run(tuner, 24)
    assert tuner.threads() == 2


def test_a_small_difference_does_not_switch() -> None:
    machine = Machine({2: 0.010, 1: 0.0095})  # 5% apart: within the margin
    tuner = ThreadTuner((2, 1), machine.applied.append, exploit_steps=20, probe_steps=4)
    machine.run(tuner, 240)
    assert tuner.threads() == 2


def test_only_steps_of_the_same_size_are_compared() -> None:
    # The probe's steps have other token counts than the default's: no comparison, no switch,
    # even though they took less time (they were smaller steps).
    machine = Machine({2: 0.030, 1: 0.001})
    tuner = ThreadTuner((2, 1), machine.applied.append, exploit_steps=20, probe_steps=4)
    machine.run(tuner, 20, tokens=32)
    machine.run(tuner, 4, tokens=1)
    assert tuner.threads() == 2


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="two different thread counts"):
        ThreadTuner((2, 2), print)
    with pytest.raises(ValueError, match="margin"):
        ThreadTuner((2, 1), print, margin=1.5)


def test_only_a_default_count_above_one_is_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cpus", lambda: 4.0)
    try:
        threads.apply_threads(None)
        assert threads.tunable_thread_counts() == (4, 1)
        threads.apply_threads(3)  # --threads: the user's choice stays
        assert threads.tunable_thread_counts() is None
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        threads.apply_threads(None)
        assert threads.tunable_thread_counts() is None
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(threads, "available_cpus", lambda: 1.0)
        threads.apply_threads(None)
        assert threads.tunable_thread_counts() is None
    finally:
        torch.set_num_threads(before)
        monkeypatch.setattr(threads, "_default_chosen", None)


def test_an_engine_switching_threads_mid_generation_gives_the_same_tokens(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine builds a tuner when the count was chosen by default; here it probes every few
    # steps, so generation crosses several switches of torch's thread count. Every kernel's
    # arithmetic is independent of its thread count: the greedy tokens are those of an engine
    # without a tuner.
    import torch

    from kvasir.runtime.config import EngineConfig
    from kvasir.runtime.engine import llm_engine
    from kvasir.runtime.sample.params import SamplingParams

    path = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    prompts = [[5, 9, 13, 17, 21], [7, 8, 9], [30, 31, 32, 33, 34, 35, 36]]
    config = EngineConfig(model=str(path), device="cpu", dtype="float32")
    before = torch.get_num_threads()
    try:
        plain = llm_engine.LLMEngine(config)
        assert plain.thread_tuner is None  # nobody applied a default count in this process
        expected = [result.choices[0].token_ids for result in plain.generate(prompts, params)]
        monkeypatch.setattr(llm_engine, "tunable_thread_counts", lambda: (2, 1))
        tuned = llm_engine.LLMEngine(config)
        assert tuned.thread_tuner is not None
        counts: list[int] = []
        tuned.thread_tuner = ThreadTuner(
            (2, 1), lambda n: (counts.append(n), threads.set_torch_threads(n)), exploit_steps=3, probe_steps=2
        )
        got = [result.choices[0].token_ids for result in tuned.generate(prompts, params)]
        assert got == expected
        assert counts.count(1) >= 3  # it did probe, several times
    finally:
        torch.set_num_threads(before)
