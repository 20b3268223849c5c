"""`kvasir render` and `kvasir operator` registration; `kvasir --help` never imports kopf."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import yaml

from kvasir.cli import main


def test_render_prints_the_children(kt, capsys) -> None:
    sample = str(kt.REPO / "crds/samples/full.yaml")
    assert main(["render", "-f", sample, "-n", "inference", "--service-monitor"]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [(d["kind"], d["metadata"]["name"], d["metadata"]["namespace"]) for d in documents] == [
        ("Deployment", "mistral-7b", "inference"),
        ("Service", "mistral-7b", "inference"),
        ("PodDisruptionBudget", "mistral-7b", "inference"),
        ("ServiceMonitor", "mistral-7b", "inference"),
    ]
    assert all("ownerReferences" not in d["metadata"] for d in documents)


def test_render_namespace_and_stdin(kt, capsys, monkeypatch) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO((kt.REPO / "crds/samples/minimal.yaml").read_text()))
    assert main(["render", "-f", "-", "-n", "ml"]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {d["metadata"]["namespace"] for d in documents} == {"ml"}
    assert len(documents) == 3


def test_render_reports_an_unusable_spec(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: inference.kvasir.dev/v1alpha1\nkind: LLMDeployment\nmetadata: {name: x}\n"
        "spec: {model: {source: 'hf://org/na me'}}\n"
    )
    assert main(["render", "-f", str(bad)]) == 2
    assert f"{bad}: line 4: spec.model.source: " in capsys.readouterr().err


def test_operator_subcommand_is_registered(capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["operator", "--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    assert "--namespace" in out and "--no-leader-election" in out


def test_help_and_render_never_import_kopf(kt) -> None:
    code = (
        "import sys; from kvasir.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        f"main(['render', '-f', {str(kt.REPO / 'crds/samples/minimal.yaml')!r}])\n"
        "assert 'kopf' not in sys.modules, 'kopf imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def _operator(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvasir.cli", "operator", "--no-leader-election", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def test_operator_start_up_problems_are_one_line_and_status_2(tmp_path) -> None:
    """No credentials, or a port already taken: one line saying which, no traceback."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "missing")}
    done = _operator("--http-host", "127.0.0.1", "--http-port", "0", env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"kvasir operator: cannot log in to Kubernetes: {tmp_path / 'missing'}: No such file or directory"
    )
    assert "Traceback" not in done.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _operator("--http-host", "127.0.0.1", "--http-port", str(port), env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"kvasir operator: cannot serve /healthz and /metrics on 127.0.0.1:{port}: "
    )


@pytest.mark.parametrize(
    ("flag", "value"), [("--http-port", "99999"), ("--resync-seconds", "0"), ("--scrape-timeout", "-1")]
)
def test_operator_flags_out_of_range_are_refused(capsys, flag: str, value: str) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["operator", flag, value])
    assert caught.value.code == 2
    assert f"argument {flag}: must be" in capsys.readouterr().err
