"""The canary config refuses what it used to take silently: booleans for numbers, keys given
twice, thresholds their window never reaches, arm variables the engine would refuse, engine
arguments vLLM would refuse, a host or app name that cannot work. No Ray; vLLM only in a
subprocess (its parser loads vLLM's plugins, which must not register in this process)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from argparse import ArgumentParser, BooleanOptionalAction
from pathlib import Path

import pytest

pytest.importorskip("pydantic")
pytest.importorskip("yaml")

from fuselane.serving.canary.config import (
    CanaryConfigError,
    RollbackSpec,
    load_config,
    parse_config,
)
from fuselane.serving.canary.config_checks import engine_argv, load_yaml
from fuselane.serving.canary.rollback import RollbackJudge

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "serving" / "configs"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def _load(tmp_path: Path, model: Path, body: str) -> object:
    path = tmp_path / "canary.yaml"
    path.write_text(f"model: {{id: t, source: {model}}}\n" + textwrap.dedent(body))
    return load_config(path)


def _refused(tmp_path: Path, model: Path, body: str) -> str:
    with pytest.raises(CanaryConfigError) as e:
        _load(tmp_path, model, body)
    return str(e.value)


# Each YAML below was accepted before (the silent reading in the comment); each error must name
# the field and say what is wrong.
BAD = {
    # weight 1.0, replicas 1, rollback on
    "bool weight": ("routing: {weight: true}", ["routing.weight", "valid number", "True"]),
    "bool replicas": ("arms: {custom: {replicas: true}}", ["arms.custom.replicas", "True"]),
    "bool window": ("rollback: {window: true}", ["rollback.window", "True"]),
    "int flag": ("rollback: {enabled: 1}", ["rollback.enabled", "valid boolean"]),
    "bool age": ("rollback: {window_s: true}", ["rollback.window_s", "True"]),
    "zero age": ("rollback: {window_s: 0}", ["rollback.window_s", "greater than 0"]),
    "bool threshold": ("rollback: {max_latency_ratio: true}", ["rollback.max_latency_ratio"]),
    # the rules never judge
    "min_requests above window": (
        "rollback: {window: 10, min_requests: 11}",
        ["rollback.min_requests: 11 is above rollback.window (10)", "at most 10"],
    ),
    "min_shadow_samples above window": (
        "rollback: {window: 8, min_requests: 8, min_shadow_samples: 9}",
        ["rollback.min_shadow_samples: 9 is above rollback.window (8)", "agreement rule"],
    ),
    "error rate never exceeded": (
        "rollback: {max_error_rate: 1.0}",
        ["rollback.max_error_rate: 1 can never be exceeded", "below 1"],
    ),
    "latency ratio below 1": (
        "rollback: {max_latency_ratio: 0.5}",
        ["rollback.max_latency_ratio: 0.5 would roll back a custom arm as fast as stock", "null"],
    ),
    "interpreted latency ratio below 1": (
        "rollback: {max_latency_ratio_interpreted: 0.9}",
        ["rollback.max_latency_ratio_interpreted: 0.9", "at least 1"],
    ),
    "agreement never undercut": (
        "rollback: {min_agreement: 0}",
        ["rollback.min_agreement: 0 can never be undercut", "null"],
    ),
    # the engine refused it 89 s into the deploy, as DEPLOY_FAILED
    "kernels attn": (
        "arms: {custom: {env: {FUSELANE_KERNELS: attn}}}",
        ["arms.custom.env.FUSELANE_KERNELS", "'attn'", "valid values: attention, kv_cache"],
    ),
    "telemetry maybe": (
        "arms: {custom: {env: {FUSELANE_TELEMETRY: maybe}}}",
        ["arms.custom.env.FUSELANE_TELEMETRY", "'maybe'", "expected one of 1, on"],
    ),
    "fault all,none": (
        "arms: {custom: {env: {FUSELANE_FAULT_INJECT: 'all,none'}}}",
        ["arms.custom.env.FUSELANE_FAULT_INJECT", "stand alone"],
    ),
    "telemetry port host": (
        "env: {FUSELANE_TELEMETRY_PORT: 'no such host!:9400'}",
        ["env.FUSELANE_TELEMETRY_PORT", "'no such host!'"],
    ),
    "shared kernels reach stock": (
        "env: {FUSELANE_KERNELS: all}\narms: {stock: {replicas: 1}}",
        ["env.FUSELANE_KERNELS: the stock arm runs vLLM's own kernels", "arms.custom.env"],
    ),
    # Serve failed later, or bound nothing
    "host": ("http: {host: 'not a host!'}", ["http.host", "'not a host!'", "IP address"]),
    "name": ("name: a/b", ["name:", "'a/b'", "letters, digits"]),
    "engine model": ("engine: {model: x}", ["engine.model", "model.source"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_is_refused_with_the_field_named(tmp_path, model_dir, case):
    body, fragments = BAD[case]
    msg = _refused(tmp_path, model_dir, body + "\n")
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_a_key_given_twice_is_refused_with_its_path_and_lines(tmp_path, model_dir):
    msg = _refused(
        tmp_path, model_dir, "routing:\n  weight: 0.1\n  session_header: s\n  weight: 0.9\n"
    )
    assert "line 5: duplicate key routing.weight (first given at line 3)" in msg
    # merge keys may be overridden, as YAML intends
    data = load_yaml("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\n")
    assert data["other"] == {"x": 1, "y": 3}


def test_every_env_error_is_listed_at_once_and_a_shared_one_once(model_dir):
    data = {
        "model": {"id": "t", "source": str(model_dir)},
        "env": {"FUSELANE_TELEMETRY_FLUSH_S": "1e300"},
        "arms": {"custom": {"env": {"FUSELANE_KERNELS": "attn"}}},
    }
    with pytest.raises(CanaryConfigError) as e:
        parse_config(data)
    lines = str(e.value).splitlines()[1:]
    assert [ln.strip().split(":")[0] for ln in lines] == [
        "env.FUSELANE_TELEMETRY_FLUSH_S",
        "arms.custom.env.FUSELANE_KERNELS",
    ]
    assert "3600" in lines[0]


def test_non_loopback_host_is_accepted_with_a_warning(tmp_path, model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="fuselane.serving.canary.config"):
        c = _load(tmp_path, model_dir, "http: {host: 0.0.0.0}\nshadow: {fraction: 0.1}\n")
    assert c.http.host == "0.0.0.0"
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'canary.yaml'}: http.host: 0.0.0.0 is not a loopback address: the "
        "canary's OpenAI endpoint (no authentication) is reachable from other machines; "
        "127.0.0.1 keeps it on this one"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fuselane.serving.canary.config"):
        for host in ("127.0.0.1", "localhost", "::1"):
            _load(tmp_path, model_dir, f"http: {{host: '{host}'}}\nshadow: {{fraction: 0.1}}\n")
    assert caplog.records == []


def test_runtime_fields_pin_and_latency_rule(model_dir):
    base = {"model": {"id": "t", "source": str(model_dir)}}
    c = parse_config(base)
    assert c.routing.allow_pin_custom is False  # the pin header pins custom only when allowed
    assert parse_config({**base, "routing": {"allow_pin_custom": True}}).routing.allow_pin_custom
    # rollback.py's windows age out after window_s; interpreted kernels have a ratio of their own
    assert (c.rollback.window_s, c.rollback.max_latency_ratio_interpreted) == (600.0, None)
    r = parse_config(
        {**base, "rollback": {"window_s": None, "max_latency_ratio_interpreted": 50}}
    ).rollback
    assert (r.window_s, r.max_latency_ratio_interpreted) == (None, 50.0)
    # `max_latency_ratio: null` switches the latency rule off; the other rules still judge.
    spec = parse_config({**base, "rollback": {"max_latency_ratio": None}}).rollback
    assert spec.max_latency_ratio is None
    judge = RollbackJudge(spec)
    for _ in range(spec.window):
        judge.add_outcome("stock", True, 0.1)
        judge.add_outcome("custom", True, 10.0)
    assert judge.judge() is None
    assert RollbackSpec(window=5, min_requests=5, min_shadow_samples=5).min_requests == 5


def test_engine_argv_is_strict_about_types():
    parser = ArgumentParser()
    flag = parser.add_argument("--enforce-eager", action=BooleanOptionalAction)
    number = parser.add_argument("--max-num-seqs", type=int)
    listed = parser.add_argument("--served-model-name", nargs="+")
    mapping = parser.add_argument("--hf-overrides")
    assert engine_argv(flag, True) == ["--enforce-eager"]
    assert engine_argv(flag, False) == ["--no-enforce-eager"]
    assert "expected true or false" in engine_argv(flag, "yes")
    assert "not a boolean" in engine_argv(number, True)
    assert engine_argv(number, 32) == ["--max-num-seqs", "32"]
    assert engine_argv(listed, ["a", "b"]) == ["--served-model-name", "a", "b"]
    assert engine_argv(mapping, {"rms_norm_eps": 0.1}) == [
        "--hf-overrides",
        '{"rms_norm_eps": 0.1}',
    ]


# Runs load_config with vLLM's parser in a fresh process: the example configs pass, a config
# with engine arguments vLLM refuses is refused before anything is deployed.
_ENGINE_CHECK = """
import json, sys
from fuselane.serving.canary.config import CanaryConfigError, load_config
out = {}
for path in sys.argv[1:]:
    try:
        load_config(path, check_paths=False)
        out[path] = "ok"
    except CanaryConfigError as e:
        out[path] = str(e)
print("RESULT " + json.dumps(out))
"""


def test_engine_arguments_are_parsed_by_vllm_before_deploying(tmp_path, model_dir):
    pytest.importorskip("vllm")
    bad = tmp_path / "engine.yaml"
    bad.write_text(
        f"model: {{id: t, source: {model_dir}}}\n"
        "engine: {dtype: float33, max_model_len: 512, enforce_eager: true}\n"
        "arms:\n"
        "  custom:\n"
        "    engine: {max_modle_len: 64, tensor_parallel_size: two, max_num_seqs: true,\n"
        "             hf_overrides: {rms_norm_eps: 0.1}}\n"
    )
    paths = [str(CONFIGS / "canary-cpu-tiny.yaml"), str(CONFIGS / "canary-gpu.yaml"), str(bad)]
    proc = subprocess.run(
        [sys.executable, "-c", _ENGINE_CHECK, *paths],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out[paths[0]] == "ok" and out[paths[1]] == "ok"
    msg = out[paths[2]]
    assert "engine.dtype: vLLM's parser refuses '--dtype float33'" in msg
    assert "invalid choice: 'float33'" in msg
    assert "arms.custom.engine.max_modle_len: not an engine argument of vLLM" in msg
    assert "did you mean 'max_model_len'?" in msg
    assert "arms.custom.engine.tensor_parallel_size" in msg and "'two'" in msg
    assert "arms.custom.engine.max_num_seqs" in msg and "not a boolean" in msg
    for good in ("max_model_len:", "enforce_eager", "hf_overrides"):
        assert good not in msg, msg
