"""The canary's config schema, routing split, shadow comparison and rollback rules (no Ray)."""

import argparse
import random
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
from fuselane.serving.canary.rollback import RollbackJudge
from fuselane.serving.canary.shadow import compare, extract, shadow_copy
from fuselane.serving.canary.split import choose_arm, key_point, sticky_key

CONFIGS = Path(__file__).resolve().parents[2] / "serving" / "configs"


def _base(tmp_path: Path) -> dict:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return {"model": {"id": "tiny", "source": str(model)}}


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "canary.yaml"
    p.write_text(text)
    return p


def _error(tmp_path: Path, text: str) -> str:
    with pytest.raises(CanaryConfigError) as e:
        load_config(_write(tmp_path, text))
    return str(e.value)


def test_weight_above_one_is_refused_with_the_field_named(tmp_path):
    src = _base(tmp_path)["model"]["source"]
    msg = _error(tmp_path, f"model: {{id: t, source: {src}}}\nrouting: {{weight: 1.5}}\n")
    assert "routing.weight" in msg and "1.5" in msg


def test_unknown_arm_is_refused_with_the_arms_listed(tmp_path):
    src = _base(tmp_path)["model"]["source"]
    msg = _error(tmp_path, f"model: {{id: t, source: {src}}}\narms: {{canary: {{replicas: 1}}}}\n")
    assert "arms.canary: unknown arm 'canary'; the arms are stock, custom" in msg


def test_missing_model_is_refused(tmp_path):
    msg = _error(tmp_path, "routing: {weight: 0.1}\n")
    assert "model: required field missing" in msg
    msg = _error(tmp_path, "model: {id: t}\n")
    assert "model.source: required field missing" in msg


def test_model_directory_that_does_not_exist_is_refused(tmp_path):
    msg = _error(tmp_path, f"model: {{id: t, source: {tmp_path / 'nope'}}}\n")
    assert "model.source: no such directory" in msg


def test_every_bad_field_is_listed_at_once(tmp_path):
    msg = _error(tmp_path, "routing: {wieght: 0.2}\nshadow: {fraction: -1}\n")
    assert "model: required field missing" in msg
    assert "routing.wieght: unknown field" in msg
    assert "shadow.fraction" in msg


def test_stock_arm_cannot_run_fuselane_kernels(tmp_path):
    data = _base(tmp_path) | {"arms": {"stock": {"env": {"FUSELANE_KERNELS": "all"}}}}
    with pytest.raises(CanaryConfigError, match=r"arms\.stock\.env\.FUSELANE_KERNELS"):
        parse_config(data)


def test_arm_environment_and_engine_merge(tmp_path):
    data = _base(tmp_path) | {
        "engine": {"dtype": "float32", "max_model_len": 512},
        "env": {"VLLM_CPU_KVCACHE_SPACE": 1},
        "arms": {"custom": {"env": {"FUSELANE_TELEMETRY": True}, "engine": {"seed": 3}}},
    }
    c = parse_config(data)
    assert c.arm_env("stock") == {"VLLM_CPU_KVCACHE_SPACE": "1", "FUSELANE_KERNELS": "none"}
    assert c.arm_env("custom") == {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "FUSELANE_TELEMETRY": "1",
        "FUSELANE_KERNELS": "all",
    }
    assert c.arm_engine_kwargs("custom") == {"dtype": "float32", "max_model_len": 512, "seed": 3}


@pytest.mark.parametrize("name", ["canary-cpu-tiny.yaml", "canary-gpu.yaml"])
def test_example_configs_are_valid(name):
    # vLLM's reading of their engine arguments: test_canary_config_strict.py, in a subprocess
    c = load_config(CONFIGS / name, check_paths=False, check_engine=False)
    assert Path(c.model.source).is_absolute() or "/" in c.model.source


def test_relative_model_path_becomes_absolute(tmp_path, monkeypatch):
    _base(tmp_path)
    monkeypatch.chdir(tmp_path)
    c = load_config(_write(tmp_path, "model: {id: t, source: ./model}\n"))
    assert c.model.source == str(tmp_path / "model")


def test_sticky_keys_are_stable_and_monotone_in_weight():
    keys = [f"user-{i}" for i in range(400)]
    points = [key_point(k) for k in keys]
    assert points == [key_point(k) for k in keys]  # no per-process salt
    assert all(0.0 <= p < 1.0 for p in points)
    custom_at = {w: {k for k in keys if choose_arm(w, key=k).arm == "custom"} for w in (0.2, 0.5)}
    assert custom_at[0.2] <= custom_at[0.5]  # raising the weight only moves keys to custom
    assert 0.1 < len(custom_at[0.2]) / 400 < 0.3


def test_sticky_key_sources_and_pins():
    assert sticky_key({"x-session-id": "abc"}, {"user": "u"}, "x-session-id", True) == "s:abc"
    assert sticky_key({}, {"user": "u"}, "x-session-id", True) == "u:u"
    assert sticky_key({}, {"user": "u"}, "x-session-id", False) is None
    assert choose_arm(0.0, pin="Custom", allow_pin_custom=True).arm == "custom"
    with pytest.raises(ValueError, match="unknown arm 'canary'"):
        choose_arm(0.5, pin="canary")


def test_weighted_split_is_binomial():
    rng = random.Random(7)
    n = 4000
    k = sum(choose_arm(0.25, rng=rng).arm == "custom" for _ in range(n))
    assert abs(k - n * 0.25) < 4 * (n * 0.25 * 0.75) ** 0.5


def test_shadow_copy_is_greedy_bounded_and_asks_for_ids():
    body = {"model": "m", "prompt": "p", "max_tokens": 100, "stream": True, "temperature": 0.9}
    copy = shadow_copy(body, chat=False, max_tokens_cap=16)
    assert copy["temperature"] == 0.0 and copy["stream"] is False and copy["max_tokens"] == 16
    assert copy["return_token_ids"] is True and copy["logprobs"] == 0
    chat = shadow_copy({"messages": [], "max_completion_tokens": 4}, chat=True, max_tokens_cap=16)
    assert chat["max_tokens"] == 4 and chat["logprobs"] is True
    assert "max_completion_tokens" not in chat


def test_compare_counts_the_common_prefix():
    c = compare([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0], [1, 2, 9, 9], [-1.0, -2.5, -1.0, -1.0])
    assert c.common_prefix == 2 and c.agreement == 0.5 and not c.exact
    assert c.max_logprob_diff == pytest.approx(0.5)
    same = compare([5], [-0.1], [5], [-0.1])
    assert same.exact and same.agreement == 1.0 and same.max_logprob_diff == 0.0
    assert compare([], [], [], []).agreement == 1.0
    resp = {"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.5, -0.25]}}]}
    assert extract(resp, chat=False) == ([1, 2], [-0.5, -0.25])
    chat = {"choices": [{"token_ids": [3], "logprobs": {"content": [{"logprob": -1.0}]}}]}
    assert extract(chat, chat=True) == ([3], [-1.0])


def test_rollback_thresholds():
    judge = RollbackJudge(RollbackSpec(min_requests=10, max_error_rate=0.1, min_shadow_samples=5))
    for _ in range(9):
        judge.add_outcome("custom", False, None)
    assert judge.judge() is None  # too few outcomes to judge a rate
    judge.add_outcome("custom", False, None)
    assert judge.judge().reason == "error_rate"
    judge.reset_custom()
    for _ in range(20):
        judge.add_outcome("stock", True, 0.1)
        judge.add_outcome("custom", True, 0.5)
    b = judge.judge()
    assert b.reason == "latency_ratio" and "5.00 > 3" in b.detail
    judge = RollbackJudge(RollbackSpec(min_shadow_samples=5, min_agreement=0.9))
    for a in (1.0, 1.0, 0.5, 1.0, 0.6):
        judge.add_agreement(a)
    assert judge.judge().reason == "agreement"
    judge = RollbackJudge(RollbackSpec(max_numerical_check_failures=0))
    judge.check_failures = 1
    assert judge.judge().reason == "numerical_checks"
    assert RollbackJudge(RollbackSpec(enabled=False)).judge() is None


def test_cli_refuses_weight_out_of_range_and_bad_config(tmp_path, capsys):
    from fuselane.serving.canary.cli import add_parser

    parser = argparse.ArgumentParser(prog="fuselane")
    add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["canary", "weight", "1.5"])
    assert e.value.code == 2
    assert "must be between 0 and 1, got 1.5" in capsys.readouterr().err
    bad = _write(tmp_path, "model: {id: t, source: /nonexistent/model}\nrouting: {weight: 2}\n")
    args = parser.parse_args(["canary", "deploy", str(bad)])
    assert args.func(args) == 2
    assert "routing.weight" in capsys.readouterr().err


def test_a_redeploy_keeps_the_live_weight_unless_asked(tmp_path):
    from fuselane.serving.canary.control import deploy_user_config

    data = _base(tmp_path)
    data["routing"] = {"weight": 0.25}
    config = parse_config(data)
    fresh, line = deploy_user_config(config, None)
    assert fresh == config.user_config() and "new deployment" in line

    live = {"weight": 0.6, "shadow_fraction": 0.5, "epoch": 3}
    kept, line = deploy_user_config(config, live)
    assert kept == {"weight": 0.6, "shadow_fraction": 0.5, "epoch": 3}
    assert "weight 0.6" in line and "kept from the running canary" in line
    assert "the file says 0.25" in line

    # Asked for: the file's values, the live epoch (a redeploy does not clear a rollback).
    asked, line = deploy_user_config(config, live, weight_from_file=True)
    assert asked == {"weight": 0.25, "shadow_fraction": config.shadow.fraction, "epoch": 3}
    assert "from the file, as asked" in line and "had 0.6" in line
