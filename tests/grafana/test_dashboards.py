"""The committed dashboards: current, conventional, reading only metrics the code exports.

The live half (every query returns data from a real serving run) is in the serving test
modules, at the end of each run: see runs.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grafana_foundation_sdk")

from fuselane.serving.cli import main
from fuselane.serving.dashboards import build_all, canary, kernels
from fuselane.serving.dashboards.cli import stale

from .panels import DASHBOARD_DIR, panel_queries
from .promql import metric_names, substitute
from .runs import NOT_REQUIRED, RUNS

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"


@pytest.fixture(scope="module")
def models() -> dict[str, dict]:
    return {m["uid"]: m for m in build_all().values()}


def test_committed_json_is_current():
    assert stale(DASHBOARD_DIR) == [], "regenerate with `fuselane dashboards`"
    generated = set(build_all())
    committed = {p.name for p in DASHBOARD_DIR.glob("*.json")}
    assert committed == generated, f"not generated: {committed - generated}"


def test_check_mode_names_the_stale_file(tmp_path, capsys):
    out = tmp_path / "dashboards"
    shutil.copytree(DASHBOARD_DIR, out)
    assert main(["dashboards", "--check", "--out", str(out)]) == 0
    path = out / "fuselane-canary.json"
    model = json.loads(path.read_text())
    model["panels"][1]["title"] = "edited by hand"
    path.write_text(json.dumps(model))
    (out / "fuselane-kernels.json").unlink()
    capsys.readouterr()
    assert main(["dashboards", "--check", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: stale" in err and "fuselane-kernels.json: missing" in err
    assert main(["dashboards", "--out", str(out)]) == 0
    assert main(["dashboards", "--check", "--out", str(out)]) == 0


def test_conventions(models):
    assert set(models) == {kernels.UID, canary.UID}
    for uid, model in models.items():
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource", uid
        assert any("vllm" in link.get("tags", []) for link in model["links"]), uid
        titles = [p["title"] for p in model["panels"] if p["type"] != "row"]
        assert len(titles) == len(set(titles)), f"{uid}: panel titles must be unique"
        for p in model["panels"]:
            if p["type"] == "row":
                continue
            assert p["datasource"]["uid"] == "${datasource}", (uid, p["title"])
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
        for q in panel_queries(model):
            windows = re.findall(r"\b(?:rate|increase)\([^\[]*\[([^\]]*)\]", q.expr)
            assert all(w == "$__rate_interval" for w in windows), (uid, q.title, windows)


def _exported_kernel_series() -> set[str]:
    """Series names of the plugin's telemetry, from its metric objects (a fresh process: they
    register in prometheus_client's default registry)."""
    code = (
        "import json\n"
        "from prometheus_client import REGISTRY\n"
        "from fuselane.plugin.telemetry_metrics import KernelMetrics\n"
        "KernelMetrics()\n"
        "print(json.dumps([(f.name, f.type) for f in REGISTRY.collect()]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    families = json.loads(out.splitlines()[-1])
    return {
        s for name, kind in families if name.startswith("fuselane_") for s in _series(name, kind)
    }


def _series(name: str, kind: str) -> list[str]:
    if kind == "counter":
        return [name if name.endswith("_total") else name + "_total"]
    if kind == "histogram":
        return [f"{name}_bucket", f"{name}_count", f"{name}_sum"]
    return [name]


def _exported_canary_series() -> set[str]:
    """Series names of the canary's metrics as Ray exports them (`ray_` + name)."""
    pytest.importorskip("ray")
    from ray.util.metrics import Counter, Histogram

    from fuselane.serving.canary.metrics import IngressMetrics, MonitorMetrics

    names = set()
    for holder in (IngressMetrics(), MonitorMetrics()):
        for m in vars(holder).values():
            kind = (
                "counter"
                if isinstance(m, Counter)
                else "histogram"
                if isinstance(m, Histogram)
                else "gauge"
            )
            names.update("ray_" + s for s in _series(m.info["name"], kind))
    return names


def test_every_metric_is_one_the_code_exports(models):
    kernel = _exported_kernel_series()
    assert "fuselane_kernel_launches_total" in kernel
    # the canary mirrors each kernel series into Ray's export under its own name
    exported = kernel | {"ray_" + s for s in kernel} | _exported_canary_series()
    used: dict[str, set[str]] = {}
    for uid, model in models.items():
        for q in panel_queries(model):
            for prefix in kernels.PREFIXES:
                for name in metric_names(substitute(q.expr, {"prefix": prefix})):
                    used.setdefault(name, set()).add(f"{uid}: {q.title}")
    ours = {n for n in used if "fuselane_" in n}
    assert not ours - exported, {n: used[n] for n in ours - exported}
    # vLLM's engine metrics and Ray Serve's, through Ray: checked against a live scrape by the
    # canary runs (runs.py); nothing else may appear
    others = set(used) - ours
    assert all(n.startswith(("ray_vllm_", "ray_serve_")) for n in others), others


def test_every_panel_is_required_by_a_run(models):
    for uid, model in models.items():
        titles = {q.title for q in panel_queries(model)}
        checked_by = [run for run, uids in RUNS.items() if uid in uids]
        for run in checked_by:
            unknown = set(NOT_REQUIRED[run].get(uid, {})) - titles
            assert not unknown, f"runs.NOT_REQUIRED[{run!r}][{uid!r}]: no such panel {unknown}"
        never = {
            t for t in titles if all(t in NOT_REQUIRED[run].get(uid, {}) for run in checked_by)
        }
        assert not never, f"{uid}: panels no run has to fill: {never}"


def test_canary_names_match_the_canary():
    pytest.importorskip("pydantic")
    from fuselane.serving.canary import app, config

    assert canary.ARMS == config.ARMS
    assert canary.INGRESS == app.INGRESS


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool")
def test_prometheus_config_is_valid():
    r = subprocess.run(
        ["promtool", "check", "config", str(GRAFANA / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_mounts_the_committed_files():
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((GRAFANA / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("./"):
                assert (GRAFANA / source).exists(), mount
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/fuselane.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./dashboards:{path}:ro" in mounts
    prom = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())[
        "datasources"
    ][0]
    assert datasource["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]
