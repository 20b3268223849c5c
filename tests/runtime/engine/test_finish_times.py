"""Every way a choice ends, in either text side, leaves it exactly one finishing delta and a whole
timing record built from its deltas: arrival <= first scheduled <= first token <= finished, one
token time per token handed out. A stop string (found on the text side, maybe after the engine
already ended the choice by length) and an abort used to leave no timestamps at all."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.engine.outputs import CompletionDelta, RequestTimes, record_times
from kvasir.runtime.sample.params import SamplingParams
from tests.runtime.finish_cases import PROMPT, GreedyOutput, greedy_output


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "output-process"])
def engine(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]) -> Iterator[LLMEngine]:
    config = EngineConfig(
        model=str(tiny_checkpoint("llama")), device="cpu", max_model_len=128, output_process=request.param
    )
    llm = LLMEngine(config)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def greedy(engine: LLMEngine) -> GreedyOutput:
    return greedy_output(engine)


Choices = dict[int, tuple[list[CompletionDelta], RequestTimes]]


def _run(
    engine: LLMEngine, params: SamplingParams, *, abort_when: Callable[[Choices], bool] | None = None
) -> Choices:
    """Each choice's deltas and the timing record they build, as a server builds it; the request
    is aborted after the first step at which `abort_when(choices so far)` holds."""
    prepared = engine.prepare_request("r", params=params, prompt_token_ids=PROMPT)
    engine.add_prepared(prepared)
    choices: Choices = {}
    while engine.has_unfinished():
        for output in engine.step():
            for delta in output.outputs:
                deltas, times = choices.setdefault(delta.index, ([], RequestTimes(prepared.arrival_time)))
                deltas.append(delta)
                record_times(times, delta)
        if abort_when is not None and abort_when(choices):
            abort_when = None
            engine.abort("r")
    engine.kv_cache.check_integrity()
    assert engine.kv_cache.usage == 0.0
    return choices


def _check_one_finish_and_whole_record(deltas: list[CompletionDelta], times: RequestTimes) -> None:
    finishing = [delta for delta in deltas if delta.finished]
    assert finishing == [deltas[-1]], "exactly one finishing delta, the last one"
    assert times.first_scheduled is not None and times.first_token is not None
    assert times.finished is not None
    assert times.arrival <= times.first_scheduled <= times.first_token <= times.finished
    assert len(times.token_times) == deltas[-1].num_output_tokens == sum(len(d.token_ids) for d in deltas)
    assert times.token_times == sorted(times.token_times) and times.token_times[-1] <= times.finished


def test_length_and_stop_token_finishes(engine: LLMEngine, greedy: GreedyOutput) -> None:
    at = greedy.stop_token()
    cases = [
        (SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), "length", None, 5),
        (
            SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(greedy.token_ids[at],)),
            "stop",
            greedy.token_ids[at],
            at + 1,
        ),
    ]
    for params, reason, stop_reason, num_tokens in cases:
        (deltas, times), *_ = _run(engine, params).values()
        _check_one_finish_and_whole_record(deltas, times)
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == (reason, stop_reason)
        assert len(times.token_times) == num_tokens


@pytest.mark.parametrize("extra_tokens", [0, 1, 8], ids=["on-the-last-token", "a-token-early", "mid-output"])
@pytest.mark.parametrize("n", [1, 2])
def test_stop_string_finishes(engine: LLMEngine, greedy: GreedyOutput, extra_tokens: int, n: int) -> None:
    """The engine's length limit falls on the stop string's token, one after it (the engine may
    end the choice before the output process reports the stop string), or well after."""
    stop, at = greedy.stop_string()
    params = SamplingParams(
        temperature=0.0, max_tokens=at + 1 + extra_tokens, ignore_eos=True, stop=(stop,), n=n
    )
    choices = _run(engine, params)
    assert sorted(choices) == list(range(n))
    for deltas, times in choices.values():
        _check_one_finish_and_whole_record(deltas, times)
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
        assert len(times.token_times) == at + 1  # the token that completed the stop string is the last
        assert times.finished == times.token_times[-1]


def test_abort_after_the_first_token(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, n=2)
    choices = _run(engine, params, abort_when=bool)
    assert sorted(choices) == [0, 1]
    for deltas, times in choices.values():
        _check_one_finish_and_whole_record(deltas, times)
        assert deltas[-1].finish_reason == "abort"
        assert len(times.token_times) < 100


def test_an_abort_racing_a_stop_string_ends_the_choice_once(
    engine: LLMEngine, greedy: GreedyOutput, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The abort comes right after the engine sampled the stop string's token, while the output
    process's outputs are held back: the text side then ends the choice on the stop string after
    the engine already ended it as aborted, gets the abort's update for a choice it has ended, and
    its late stop-string report reaches an engine that has forgotten the choice. One end all the
    same: the stop string, which came first."""
    stop, at = greedy.stop_string()
    params = SamplingParams(temperature=0.0, max_tokens=at + 8, ignore_eos=True, stop=(stop,))
    held = [engine.output_process is not None]
    if engine.output_process is not None:
        take = engine.output_process.take
        monkeypatch.setattr(
            engine.output_process, "take", lambda timeout=0.0: [] if held[0] else take(timeout)
        )

    def stop_token_sampled(_: Choices) -> bool:
        request = engine.scheduler.requests.get("r")
        if request is not None and request.num_output_tokens <= at:
            return False
        held[0] = False  # from the next step on, after the abort
        return True

    ((deltas, times),) = _run(engine, params, abort_when=stop_token_sampled).values()
    _check_one_finish_and_whole_record(deltas, times)
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    assert len(times.token_times) == at + 1
