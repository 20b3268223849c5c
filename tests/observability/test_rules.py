"""The Prometheus rules: promtool accepts them, and its unit tests (rules_test.yaml) prove each
alert fires on a burning series and stays quiet on a healthy one."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from kvasir.observability.rules import BURN_RATES, rule_groups
from tests.external_tools import REPO, tool

RULES = REPO / "charts" / "kvasir" / "files" / "prometheus-rules.yaml"
UNIT_TESTS = Path(__file__).with_name("rules_test.yaml")


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    result = subprocess.run(
        [tool("promtool"), "test", "rules", str(UNIT_TESTS)],
        capture_output=True,
        text=True,
        cwd=UNIT_TESTS.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test() -> None:
    tested = set()
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        tested |= {t["alertname"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    alerts = {
        rule["alert"] for group in rule_groups()["groups"] for rule in group["rules"] if "alert" in rule
    }
    assert alerts - tested == set(), "alerts never shown to fire"


def test_recording_windows_cover_every_burn_rate_window() -> None:
    recorded = {
        rule["record"] for group in rule_groups()["groups"] for rule in group["rules"] if "record" in rule
    }
    for _, _, long, short in BURN_RATES:
        for window in (long, short):
            assert f"kvasir:request_errors:ratio_rate{window}" in recorded
            assert f"kvasir:ttft_slow:ratio_rate{window}" in recorded


def test_the_observability_doc_names_every_alert() -> None:
    doc = (REPO / "docs" / "observability.md").read_text()
    alerts = [
        rule["alert"] for group in rule_groups()["groups"] for rule in group["rules"] if "alert" in rule
    ]
    assert [alert for alert in alerts if f"`{alert}`" not in doc] == []
