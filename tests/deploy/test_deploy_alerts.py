"""The alert rules shipped in deploy/prometheus/alerts.yml: valid for Prometheus, tested with `promtool test rules`
(tests/deploy/alerts_test.yml: an interval that crosses 0 fires, one that keeps holding 0 does not), wired into
the compose stack's Prometheus, and on metrics the proxy really exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = Path(__file__).with_name("alerts_test.yml")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed: `make tools` installs it (Debian package prometheus)")
    return path


@pytest.mark.processes
def test_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    check = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "2 rules found" in check.stdout, check.stdout
    out = subprocess.run([promtool(), "test", "rules", str(ALERTS_TEST)], capture_output=True, text=True,
                         timeout=60, cwd=ALERTS_TEST.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout


@pytest.mark.processes
def test_the_rule_tests_fail_when_an_alert_reads_the_wrong_end(tmp_path: Path) -> None:
    # the unit tests can fail: an alert on the lower end of the drop (fires far too late) does not pass them
    rules = yaml.safe_load(ALERTS.read_text())
    rules["groups"][0]["rules"][0]["expr"] = "toolquake_live_drop_lower < 0"
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    test = yaml.safe_load(ALERTS_TEST.read_text())
    test["rule_files"] = ["alerts.yml"]
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(test))
    out = subprocess.run([promtool(), "test", "rules", "alerts_test.yml"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode != 0, out.stdout


def test_compose_prometheus_loads_the_rules() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    mounts = compose["services"]["prometheus"]["volumes"]
    assert "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in mounts
    assert any(Path("/etc/prometheus/alerts.yml").match(str(Path("/etc/prometheus", pattern)))
               for pattern in config["rule_files"]), config["rule_files"]


def test_alerts_read_metrics_the_proxy_declares() -> None:
    from prometheus_client import CollectorRegistry

    from toolquake.proxy.live.metrics import ScoringMetrics

    registry = CollectorRegistry()
    ScoringMetrics(registry)
    declared = {m.name for m in registry.collect()}
    used = set(re.findall(r"toolquake_\w+", ALERTS.read_text()))
    assert used and used <= declared, used - declared
