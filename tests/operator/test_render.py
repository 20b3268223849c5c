"""`kvasir render` on what users actually pass it: several files, directories and globs as
`kubectl apply -f` takes them; typos refused as the API server refuses them; unusable files
answered with one line naming the file, the line and the problem, exit status 2, no traceback."""

from __future__ import annotations

import io
import itertools
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvasir.cli import main
from kvasir.operator.api.strict_fields import CRD_FILE, load_crd, unknown_object_fields
from kvasir.operator.yaml_input import MAX_DEPTH

HEAD = "apiVersion: inference.kvasir.dev/v1alpha1\nkind: LLMDeployment\nmetadata: {name: demo}\n"


def render(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict[str, Any]], list[str]]:
    """Exit status, the manifests printed, and the lines on stderr."""
    code = main(["render", *args])
    captured = capsys.readouterr()
    return code, list(yaml.safe_load_all(captured.out)), captured.err.splitlines()


def test_the_shipped_crd_is_the_file_in_crds(kt) -> None:
    """The installed package reads the CRD of the repository (package data `kvasir.crds`), so the
    fields `render` accepts are exactly the API server's."""
    assert load_crd() == yaml.safe_load((kt.REPO / "crds" / CRD_FILE).read_text())


@pytest.mark.parametrize(
    ("spec", "unknown", "line"),
    [
        ("  replicsa: 3\n", "spec.replicsa", 6),
        ("  rutnime:\n    image: x\n", "spec.rutnime", 6),  # the key's line, not its value's
        ("  runtime:\n    maxModelLenn: 4096\n", "spec.runtime.maxModelLenn", 7),
        (
            "  autoscaling:\n    maxReplicas: 3\n    targets: {kvCacheUsge: 0.5}\n",
            "spec.autoscaling.targets.kvCacheUsge",
            8,
        ),
        (
            "  scheduling:\n    tolerations:\n      - {key: a, operatr: Exists}\n",
            "spec.scheduling.tolerations[0].operatr",
            8,
        ),
    ],
)
def test_unknown_fields_are_refused_in_the_api_servers_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, unknown: str, line: int
) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text(HEAD + "spec:\n  model: {source: hf://org/name}\n" + spec)
    code, out, err = render(capsys, "-f", str(path))
    assert (code, out) == (2, [])
    assert err == [f'kvasir render: {path}: line {line}: unknown field "{unknown}"']


def test_every_unknown_field_is_named_metadata_included() -> None:
    obj = yaml.safe_load(HEAD + "spec: {model: {source: /m}, replicsa: 1, gpus: 1}\n")
    obj["metadata"]["nmae"] = "x"
    obj["spce"] = {}
    assert unknown_object_fields(obj) == ["spec.replicsa", "spec.gpus", "spce", "metadata.nmae"]
    # Maps and fields that preserve unknown fields are free-form, as in the CRD.
    obj = yaml.safe_load(
        HEAD + "spec:\n  model: {source: /m}\n  service: {annotations: {any.thing/x: 'y'}}\n"
        "  scheduling: {nodeSelector: {pool: gpu}, affinity: {nodeAffinity: {}}}\n"
    )
    assert unknown_object_fields(obj) == []


def test_samples_have_no_unknown_fields(kt) -> None:
    for sample in kt.SAMPLES:
        assert unknown_object_fields(yaml.safe_load(sample.read_text())) == [], sample.name


def test_several_files_directories_and_globs_like_kubectl(kt, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(kt.REPO)
    samples = sorted(str(p.relative_to(kt.REPO)) for p in kt.SAMPLES)
    expected = 3 * len(samples)  # Deployment, Service, PDB each
    # What the shell makes of `-f crds/samples/*.yaml`: several names after one -f.
    assert render(capsys, "-f", *samples)[1:] == render(capsys, "-f", "crds/samples")[1:]
    code, out, _ = render(capsys, "-f", "crds/samples/*.yaml")  # quoted: expanded here
    assert code == 0 and len(out) == expected
    code, out, _ = render(capsys, "-f", samples[0], "-f", samples[1])
    assert code == 0 and len(out) == 6
    nested = tmp_path / "a" / "b"
    nested.mkdir(parents=True)
    shutil.copy(kt.REPO / "crds/samples/minimal.yaml", nested / "m.yml")
    (tmp_path / "a" / "notes.txt").write_text("not a manifest")
    assert render(capsys, "-f", str(tmp_path / "a"))[0] == 2  # no manifests at its own level
    code, out, _ = render(capsys, "-R", "-f", str(tmp_path / "a"))
    assert code == 0 and len(out) == 3


def test_inputs_that_name_no_file(tmp_path, capsys) -> None:
    (tmp_path / "empty-dir").mkdir()
    for argument, message in [
        (str(tmp_path / "nope.yaml"), "no such file or directory"),
        (str(tmp_path / "*.yaml"), "matches no files"),
        (str(tmp_path / "empty-dir"), "a directory with no .yaml, .yml or .json files"),
    ]:
        assert render(capsys, "-f", argument) == (2, [], [f"kvasir render: {argument}: {message}"])


def test_lists_json_and_stdin(kt, tmp_path, capsys, monkeypatch) -> None:
    sample = yaml.safe_load((kt.REPO / "crds/samples/minimal.yaml").read_text())
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "token"}}
    listed = tmp_path / "list.json"
    # kubectl get -o json writes a List; tabs are fine in JSON (not in YAML's indentation)
    listed.write_text(
        json.dumps({"apiVersion": "v1", "kind": "List", "items": [secret, sample]}, indent="\t")
    )
    code, out, _ = render(capsys, "-f", str(listed))
    assert code == 0 and [d["kind"] for d in out] == ["Deployment", "Service", "PodDisruptionBudget"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(yaml.safe_dump_all([secret, sample])))
    assert render(capsys, "-f", "-")[0] == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (HEAD + "spec: {model: [\n", "line 5, column 1: expected the node content"),
        (b"\xff\xfeapiVersion: v1\n", "line 1: not UTF-8 text (byte 0xff at offset 0)"),
        (
            "a: " + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5) + "\n",
            f"line 1, column {MAX_DEPTH + 3}: nested more than {MAX_DEPTH} levels deep",
        ),
        (
            "a: &a ['x','x','x','x','x','x','x','x','x','x']\n"
            + "".join(f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in itertools.pairwise("abcdefgh"))
            + "kind: Secret\napiVersion: v1\n",
            "line 5, column 4: expands to more than 100000 values",
        ),
        ("a: &a [*a]\n", "line 1, column 8: an alias refers to a node that contains it"),
        (HEAD + "spec:\n  replicas: 1\n  replicas: 2\n", 'line 6, column 3: duplicate key "replicas"'),
        ("hello\n", "line 1: expected a Kubernetes object (a mapping), got the string 'hello'"),
        ("- a\n- b\n", "line 1: expected a Kubernetes object (a mapping), got a list"),
        ("metadata: {name: x}\n", "line 1: not a Kubernetes object: apiVersion and kind not set"),
        (
            HEAD.replace("v1alpha1", "v1") + "spec: {}\n",
            "line 1: apiVersion: expected inference.kvasir.dev/v1alpha1",
        ),
        (HEAD + "spec:\n  model:\n    source: 'hf://org/na me'\n", "line 6: spec.model.source: "),
    ],
    ids=[
        "syntax",
        "not-utf8",
        "deep",
        "billion-laughs",
        "recursive-alias",
        "duplicate-key",
        "scalar",
        "list",
        "no-kind",
        "wrong-version",
        "bad-spec",
    ],
)
def test_unusable_files_get_one_line_and_status_2(tmp_path, capsys, text: str | bytes, message: str) -> None:
    path = tmp_path / "in.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, out, err = render(capsys, "-f", str(path))
    assert (code, out, len(err)) == (2, [], 1), err
    assert err[0].startswith(f"kvasir render: {path}: {message}"), err[0]


def test_python_tags_are_refused_never_run(tmp_path, capsys) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text(f'!!python/object/apply:os.system ["touch {marker}"]\n')
    code, _, err = render(capsys, "-f", str(path))
    assert code == 2 and not marker.exists()
    assert err == [
        f"kvasir render: {path}: line 1, column 1: unsupported tag "
        "!!python/object/apply:os.system: only plain YAML data is read"
    ]


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("", ""),
        ("---\n---\n", ""),
        ("apiVersion: v1\nkind: Secret\nmetadata: {name: t}\n", " (found Secret/t)"),
    ],
    ids=["empty", "empty-documents", "other-kind"],
)
def test_nothing_to_render_is_an_error(tmp_path, capsys, text: str, found: str) -> None:
    path = tmp_path / "in.yaml"
    path.write_text(text)
    assert render(capsys, "-f", str(path)) == (
        2,
        [],
        [f"kvasir render: {path}: no LLMDeployment to render{found}"],
    )


def test_every_unusable_file_is_reported_and_nothing_printed(kt, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(HEAD + "spec: {model: {source: /m}, replicsa: 2}\n")
    worse = tmp_path / "worse.yaml"
    worse.write_text("a: [\n")
    code, out, err = render(capsys, "-f", str(bad), str(kt.REPO / "crds/samples/minimal.yaml"), str(worse))
    assert (code, out) == (2, [])
    assert [line.split(": ")[1] for line in err] == [str(bad), str(worse)]


def _container_args(manifests: list[dict[str, Any]]) -> list[str]:
    deployment = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "demo")
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


@pytest.mark.parametrize("method", ["gguf", "fp8", "awq", "gptq"])
def test_quantization_reaches_the_pods_command_line(tmp_path, capsys, method: str) -> None:
    path = tmp_path / "quantized.yaml"
    path.write_text(HEAD + f"spec:\n  model: {{source: hf://org/name, quantization: {method}}}\n")
    code, manifests, _ = render(capsys, "-f", str(path))
    assert code == 0
    args = _container_args(manifests)
    assert args[args.index("--quantization") + 1] == method


def test_no_quantization_leaves_it_to_the_checkpoint(tmp_path, capsys) -> None:
    path = tmp_path / "auto.yaml"
    path.write_text(HEAD + "spec:\n  model: {source: hf://org/name}\n")
    code, manifests, _ = render(capsys, "-f", str(path))
    assert code == 0
    assert "--quantization" not in _container_args(manifests)


def test_an_unknown_quantization_is_refused_in_the_api_servers_words(tmp_path, capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(HEAD + "spec:\n  model: {source: hf://org/name, quantization: int4}\n")
    code, manifests, errors = render(capsys, "-f", str(path))
    assert code != 0 and not manifests
    assert any("spec.model.quantization" in line and "int4" in line for line in errors), errors


def test_routing_kvasir_renders_the_router_and_its_rbac(tmp_path, capsys) -> None:
    path = tmp_path / "routed.yaml"
    path.write_text(HEAD + "spec:\n  model: {source: hf://org/name}\n  routing: {mode: kvasir}\n")
    code, manifests, _ = render(capsys, "-f", str(path))
    assert code == 0
    router = {m["kind"] for m in manifests if m["metadata"]["name"] == "demo-router"}
    assert router == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}
    assert not [m for m in manifests if m["kind"] == "InferencePool"]


def test_routing_gateway_renders_the_inference_pool(tmp_path, capsys) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        HEAD + "spec:\n  model: {source: hf://org/name}\n"
        "  routing: {mode: gateway, endpointPicker: {service: epp, port: 9003}}\n"
    )
    code, manifests, _ = render(capsys, "-f", str(path))
    assert code == 0
    (pool,) = [m for m in manifests if m["kind"] == "InferencePool"]
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "epp",
        "port": {"number": 9003},
        "failureMode": "FailClose",
    }
    assert not [m for m in manifests if m["metadata"]["name"] == "demo-router"]


def test_routing_gateway_without_a_picker_renders_the_stock_picker(tmp_path, capsys) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(HEAD + "spec:\n  model: {source: hf://org/name}\n  routing: {mode: gateway}\n")
    code, manifests, _ = render(capsys, "-f", str(path))
    assert code == 0
    picker = [(m["kind"], m["metadata"]["name"]) for m in manifests if m["metadata"]["name"] == "demo-epp"]
    assert picker == [
        ("ServiceAccount", "demo-epp"),
        ("Role", "demo-epp"),
        ("RoleBinding", "demo-epp"),
        ("Deployment", "demo-epp"),
        ("Service", "demo-epp"),
    ]
    (pool,) = [m for m in manifests if m["kind"] == "InferencePool"]
    assert pool["spec"]["endpointPickerRef"]["name"] == "demo-epp"


def test_routing_gateway_with_both_a_picker_service_and_image_is_refused(tmp_path, capsys) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        HEAD + "spec:\n  model: {source: hf://org/name}\n"
        "  routing: {mode: gateway, endpointPicker: {service: epp, image: 'epp:v1'}}\n"
    )
    code, manifests, errors = render(capsys, "-f", str(path))
    assert code != 0 and not manifests
    assert any("routing.endpointPicker.image" in line for line in errors), errors


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("deep.json", "[" * 100_000 + "]" * 100_000, f"nested more than {MAX_DEPTH} levels deep"),
        (
            "deeper.json",
            "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1),
            f"nested more than {MAX_DEPTH} levels",
        ),
        ("wide.json", json.dumps([[0] * 1000] * 101), "holds more than 100000 values"),
        ("deep.yaml", "a: " + "[" * 100_000 + "]" * 100_000 + "\n", f"nested more than {MAX_DEPTH} levels"),
    ],
)
def test_deeply_nested_input_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    code, out, err = render(capsys, "-f", str(path))
    assert (code, out, len(err)) == (2, [], 1), err
    assert err[0].startswith(f"kvasir render: {path}: ") and message in err[0], err[0]


def test_input_larger_than_the_bound_is_refused_before_it_is_parsed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvasir.operator import render_files, yaml_input

    assert yaml_input.MAX_INPUT_BYTES == 8 << 20  # docs/user-guide.md states it
    parsed: list[str] = []

    def load_documents(text: str, **_: object) -> list[object]:
        parsed.append(text)
        return []

    monkeypatch.setattr(render_files, "load_documents", load_documents)
    path = tmp_path / "huge.yaml"
    with path.open("w") as out:  # a YAML comment: cheap to write, would be slow to parse
        out.write("#" + "x" * (8 << 20) + "\n")
    code, manifests, err = render(capsys, "-f", str(path))
    assert (code, manifests, err) == (2, [], [f"kvasir render: {path}: larger than 8 MiB: too large to read"])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(path.read_bytes())))
    assert render(capsys, "-f", "-") == (
        2,
        [],
        ["kvasir render: <stdin>: larger than 8 MiB: too large to read"],
    )
    assert parsed == []


@pytest.mark.parametrize(
    ("written", "stored"), [("3", 3), ("3.0", 3), ("1e2", 100), ("1.5e1", 15), ("2E+0", 2)]
)
def test_integral_floats_are_integers_as_the_api_server_stores_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], written: str, stored: int
) -> None:
    """kubectl sends YAML's `3.0` and `1e2` (go-yaml reads both as numbers) as 3 and 100, and the
    API server takes any float without a fraction for a field of type integer."""
    path = tmp_path / "replicas.yaml"
    path.write_text(HEAD + f"spec:\n  model: {{source: hf://org/name}}\n  replicas: {written}\n")
    code, manifests, err = render(capsys, "-f", str(path))
    assert code == 0, err
    deployment = next(m for m in manifests if m["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == stored and type(deployment["spec"]["replicas"]) is int


def test_every_integer_field_takes_an_integral_float(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "floats.yaml"
    path.write_text(
        HEAD
        + "spec:\n  model: {source: hf://org/name}\n  service: {port: 9000.0}\n"
        + "  autoscaling: {minReplicas: 1.0, maxReplicas: 4e0}\n  rollout: {maxUnavailable: 1.0}\n"
        + "  runtime: {maxNumSeqs: 64.0}\n"
        + "  scheduling:\n    tolerations: [{key: a, operator: Exists, effect: NoExecute, tolerationSeconds: 3e1}]\n"
    )
    code, manifests, err = render(capsys, "-f", str(path))
    assert code == 0, err
    deployment = next(m for m in manifests if m["kind"] == "Deployment")
    service = next(m for m in manifests if m["kind"] == "Service")
    assert service["spec"]["ports"][0]["port"] == 9000
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "64"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 1


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("3.5", "must be an integer, got 3.5"),
        (".nan", "must be an integer, got nan"),
        ("1e30", "must be an integer"),
    ],
)
def test_fractional_and_unbounded_floats_are_still_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], written: str, message: str
) -> None:
    path = tmp_path / "replicas.yaml"
    path.write_text(HEAD + f"spec:\n  model: {{source: hf://org/name}}\n  replicas: {written}\n")
    code, _, err = render(capsys, "-f", str(path))
    assert code == 2 and len(err) == 1 and f"spec.replicas: {message}" in err[0], err


def test_the_crd_is_read_under_a_plain_editable_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pip install -e .` (setuptools' lenient mode) puts its finder's path hook, a name that is no
    folder, in the namespace package `kvasir.crds`'s __path__; importlib.resources then refuses the
    package (NotADirectoryError: MultiplexedPath only supports directories). The CRD is read all
    the same, from the folder among the entries."""
    import importlib.resources

    import kvasir.crds
    from kvasir.operator.api import strict_fields

    hook = "__editable__.kvasir-0.1.0.finder.__path_hook__"
    entries = kvasir.crds.__path__._path
    monkeypatch.setattr(kvasir.crds.__path__, "_path", [*entries, hook])
    assert hook in list(kvasir.crds.__path__)
    with pytest.raises(NotADirectoryError):
        importlib.resources.files("kvasir.crds")
    assert strict_fields.load_crd()["spec"]["names"]["kind"] == "LLMDeployment"


def test_samples_apply_into_the_namespace_given_to_kubectl(kt) -> None:
    """A sample that named a namespace would fail `kubectl apply -f` wherever nothing made that
    namespace (and would ignore `-n`): every sample is namespace-free."""
    for sample in kt.SAMPLES:
        for doc in yaml.safe_load_all(sample.read_text()):
            assert "namespace" not in doc["metadata"], sample.name
