"""The text side in its own process: outputs equal those built in the engine's process (text,
stop strings, n > 1, logprobs), a stop string found there still ends the request in the scheduler,
and a dead output process fails loudly instead of hanging the engine."""

from __future__ import annotations

import os
import signal

import pytest

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.engine.output.process import OutputProcessError
from kvasir.runtime.sample.params import SamplingParams

PROMPTS = [[11, 12, 13, 14], [7] * 9, [20, 21, 22, 23, 24, 25]]


def engine(path, output_process: bool, **overrides: object) -> LLMEngine:
    config = EngineConfig(
        model=str(path), device="cpu", dtype="float32", output_process=output_process, **overrides
    )  # type: ignore[arg-type]
    return LLMEngine(config)


def _summary(results) -> list[tuple[object, ...]]:
    return [
        (c.text, c.token_ids, c.finish_reason, c.stop_reason, [t.token_id for t in c.logprobs or []])
        for r in results
        for c in r.choices
    ]


def test_outputs_equal_the_in_process_text_side(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama")
    local = engine(path, False)
    remote = engine(path, True)
    full = local.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    text = full[0].choices[0].text
    cases = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, seed=4, max_tokens=16, n=3),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=(text[8:11],)),
        SamplingParams(
            temperature=0.0,
            max_tokens=20,
            ignore_eos=True,
            stop=(text[8:11],),
            include_stop_str_in_output=True,
        ),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(full[1].choices[0].token_ids[4],)),
    ]
    for params in cases:
        assert _summary(remote.generate(PROMPTS, params)) == _summary(local.generate(PROMPTS, params)), params
    assert remote.output_process is not None and remote.output_process.num_outstanding == 0
    remote.kv_cache.check_integrity()
    assert remote.kv_cache.usage == 0.0
    remote.close()


def test_a_stop_string_found_there_finishes_the_request_in_the_scheduler(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama")
    llm = engine(path, True)
    full = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stop = full[0].choices[0].text[6:9]
    llm.add_request("r", prompt_token_ids=PROMPTS[0], params=SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, stop=(stop,)
    ))  # fmt: skip
    finished = None
    steps = 0
    while llm.has_unfinished():
        steps += 1
        for output in llm.step():
            if output.finished:
                finished = output
    assert finished is not None and finished.outputs[-1].finish_reason == "stop"
    # The scheduler learned it a step or two later, not after all 40 tokens.
    assert steps < 30
    assert llm.kv_cache.usage == 0.0
    llm.close()


def test_a_dead_output_process_fails_the_engine(tiny_checkpoint) -> None:
    llm = engine(tiny_checkpoint("llama"), True)
    assert llm.output_process is not None
    os.kill(llm.output_process._process.pid, signal.SIGKILL)
    llm.output_process._process.wait(10)
    with pytest.raises(OutputProcessError):  # on the add, the step that sends, or the one that takes
        llm.add_request("r", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=8))
        while llm.has_unfinished():
            llm.step()


def test_close_leaves_no_process_behind(tiny_checkpoint) -> None:
    llm = engine(tiny_checkpoint("llama"), True)
    assert llm.output_process is not None
    process = llm.output_process._process
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))
    llm.close()
    assert process.poll() == 0
