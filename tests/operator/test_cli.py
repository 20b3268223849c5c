"""`kvasir render` and `kvasir operator` registration; `kvasir --help` never imports kopf."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from kvasir.cli import main


def test_render_prints_the_children(kt, capsys) -> None:
    assert main(["render", "-f", str(kt.REPO / "crds/samples/full.yaml"), "--service-monitor"]) == 0
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
    assert main(["render", "-f", str(bad)]) == 1
    assert "is not a valid Hugging Face name" in capsys.readouterr().err


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
