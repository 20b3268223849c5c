"""`kvasir simulate` on the input users bring: recorded traces with Unix timestamps, a far-future
line, broken configs and profiles, and --plots without matplotlib. Each bad input is one line
naming the file, the line or key and the problem, with exit status 2, found before the run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvasir.cli import main
from kvasir.simulator.profile import load_profile
from kvasir.simulator.trace import read_trace

CONFIG = "profile: cpu-embedded\nautoscaling: {minReplicas: 1, maxReplicas: 3}\n"


def write_trace(path: Path, times: list[float]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"arrival_time": t, "prompt_tokens": 64, "output_tokens": 16}) + "\n" for t in times
        )
    )
    return path


def simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    config = tmp_path / "sim.yaml"
    if not config.exists():
        config.write_text(CONFIG)
    code = main(["simulate", "--config", str(config), "--policies", "kvasir,static", *args])
    return code, capsys.readouterr().err


def test_unix_timestamps_and_a_far_future_line(tmp_path: Path, capsys) -> None:
    """Times count from the first request, and a year-long idle gap is skipped, not ticked through."""
    epoch = 1.7e9
    times = [epoch + 2 * i for i in range(60)] + [epoch + 365 * 86400]
    trace = write_trace(tmp_path / "recorded.jsonl", times)
    loaded = read_trace(trace)
    assert loaded.start == epoch and loaded.requests[0].arrival_time == 0
    assert (loaded.gap, loaded.gap_line) == (365 * 86400 - 118, 61)
    out = tmp_path / "r.json"
    code, err = simulate(tmp_path, capsys, "--trace", str(trace), "--output", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["trace"]["start"] == epoch and report["trace"]["seconds"] == 365 * 86400
    assert all(p["requests"] == 61 for p in report["policies"].values())
    assert f"{trace}: 61 requests over 365.0 days" in err
    assert "note: line 61 arrives 365.0 days after the request before it" in err
    # Progress: one bar per policy, on stderr.
    assert "kvasir: 100%" in err and "static: 100%" in err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("profile: bad.json\n", "line 1: profile: {bad}: not JSON (Expecting value at line 1, column 1)"),
        (
            "slo:\n  timeToFirstTokenSeconds: fast\n",
            "line 2: slo.timeToFirstTokenSeconds: must be a number, got 'fast'",
        ),
        (
            "slo:\n  ttftSeconds: 1\n",
            "line 2: slo.ttftSeconds: renamed timeToFirstTokenSeconds (the key of spec.autoscaling.slo)",
        ),
        ("autoscale: {}\n", "line 1: autoscale: unknown key; known: autoscaling, baselines"),
        ("slo: 5\n", "line 1: slo: must be a mapping, got 5"),
        ("autoscaling: {maxReplicas: [\n", "line 2, column 1: expected the node content"),
        ("- a\n", "line 1: expected a mapping of the keys below at the top"),
    ],
    ids=[
        "profile-not-json",
        "slo-type",
        "slo-renamed-key",
        "unknown-key",
        "slo-scalar",
        "yaml-syntax",
        "a-list",
    ],
)
def test_config_errors_name_the_file_and_line(tmp_path: Path, capsys, config: str, message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("not json\n")
    (tmp_path / "sim.yaml").write_text(config.replace("bad.json", str(bad)))
    trace = write_trace(tmp_path / "t.jsonl", [0, 1])
    code, err = simulate(tmp_path, capsys, "--trace", str(trace))
    assert code == 2
    assert err.splitlines() == [err.splitlines()[0]]
    assert err.startswith(f"kvasir simulate: {tmp_path / 'sim.yaml'}: {message.format(bad=bad)}"), err


SHIPPED = load_profile("cpu-embedded").to_json()


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ({"name": "x"}, "missing profile field(s): description, step, num_kv_blocks"),
        ({**SHIPPED, "num_kv_blocks": 0}, "num_kv_blocks: must be a positive integer, got 0"),
        (
            {**SHIPPED, "step": {"per_token_s": 1}},
            "missing profile field(s): step.base_s, step.per_kv_token_s",
        ),
        ({**SHIPPED, "gpu": 1}, "unknown profile field(s): gpu"),
        ([1, 2], "a profile is a JSON object"),
    ],
    ids=["missing", "zero-blocks", "step-missing", "typo", "a-list"],
)
def test_profile_errors_name_the_field(tmp_path: Path, capsys, profile: object, message: str) -> None:
    (tmp_path / "p.json").write_text(json.dumps(profile))
    (tmp_path / "sim.yaml").write_text(f"profile: {tmp_path / 'p.json'}\n")
    code, err = simulate(tmp_path, capsys, "--trace", str(write_trace(tmp_path / "t.jsonl", [0])))
    assert code == 2 and f"line 1: profile: {tmp_path / 'p.json'}: {message}" in err, err


def test_trace_errors_name_the_file_and_line(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b'{"arrival_time": 0, "prompt_tokens": 5, "output_tokens": 3}\n\xff\n')
    assert simulate(tmp_path, capsys, "--trace", str(trace)) == (
        2,
        f"kvasir simulate: {trace}: line 2: not UTF-8 text (invalid start byte)\n",
    )
    trace.write_text('{"arrival_time": "noon", "prompt_tokens": 5, "output_tokens": 3}\n')
    code, err = simulate(tmp_path, capsys, "--trace", str(trace))
    assert code == 2 and err.startswith(f"kvasir simulate: {trace}: line 1: arrival_time, prompt_tokens")
    code, err = simulate(tmp_path, capsys, "--trace", str(tmp_path / "missing.jsonl"))
    assert (code, err) == (2, f"kvasir simulate: {tmp_path / 'missing.jsonl'}: No such file or directory\n")


def test_outputs_are_checked_before_the_run(tmp_path: Path, capsys, monkeypatch) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [0, 1])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    assert simulate(tmp_path, capsys, "--trace", str(trace), "--plots", str(tmp_path / "plots")) == (
        2,
        "kvasir simulate: --plots needs matplotlib: pip install matplotlib (or kvasir[bench])\n",
    )
    missing = tmp_path / "no" / "such" / "r.json"
    assert simulate(tmp_path, capsys, "--trace", str(trace), "--output", str(missing)) == (
        2,
        f"kvasir simulate: --output {missing}: cannot write there\n",
    )


def test_deep_or_huge_inputs_are_one_line_and_status_2(tmp_path: Path, capsys) -> None:
    """Nesting too deep for the JSON reader, and files or lines beyond their bounds, are reported
    like any other bad input, never as a traceback (issue 34, item 10)."""
    good = write_trace(tmp_path / "good.jsonl", [0, 1])
    trace = tmp_path / "deep.jsonl"
    trace.write_text(
        '{"arrival_time": 0, "prompt_tokens": 5, "output_tokens": 3, "x": '
        + "[" * 20_000
        + "]" * 20_000
        + "}\n"
    )
    assert simulate(tmp_path, capsys, "--trace", str(trace)) == (
        2,
        f"kvasir simulate: {trace}: line 1: nested too deeply to be read\n",
    )
    trace.write_text(
        json.dumps({"arrival_time": 0, "prompt_tokens": 5, "output_tokens": 3, "x": "y" * 70_000}) + "\n"
    )
    assert simulate(tmp_path, capsys, "--trace", str(trace)) == (
        2,
        f"kvasir simulate: {trace}: line 1: longer than 65536 bytes\n",
    )
    profile = tmp_path / "deep.json"
    profile.write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "sim.yaml").write_text(f"profile: {profile}\n")
    code, err = simulate(tmp_path, capsys, "--trace", str(good))
    assert (code, err) == (
        2,
        f"kvasir simulate: {tmp_path / 'sim.yaml'}: line 1: profile: {profile}: nested too deeply to be read\n",
    )
    (tmp_path / "sim.yaml").write_text("#" + "x" * (8 << 20) + "\n")
    code, err = simulate(tmp_path, capsys, "--trace", str(good))
    assert (code, err) == (
        2,
        f"kvasir simulate: {tmp_path / 'sim.yaml'}: larger than 8 MiB: too large to read\n",
    )
    (tmp_path / "sim.yaml").write_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n")
    code, err = simulate(tmp_path, capsys, "--trace", str(good))
    assert (
        code == 2
        and err.startswith(f"kvasir simulate: {tmp_path / 'sim.yaml'}: line 1, column ")
        and "nested more than 100 levels deep" in err
    )
