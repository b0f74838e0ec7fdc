"""benchmarks/e2e/rounding_sensitivity.py on a tiny Gemma-2 config (CPU): the same weights and
prompt for both attention implementations (one implementation twice differs by exactly 0), the
bands and the results file."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.test_e2e_script import REPO

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def rs():
    import importlib.util
    import sys

    path = REPO / "benchmarks" / "e2e" / "rounding_sensitivity.py"
    spec = importlib.util.spec_from_file_location("rounding_sensitivity_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture()
def tiny_gemma(tmp_path):
    cfg = json.loads((REPO / "benchmarks/e2e/models/gemma-2-9b/config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, vocab_size=100,
               sliding_window=8, sliding_window_size=8)  # fmt: skip
    folder = tmp_path / "tiny-gemma"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_one_implementation_twice_differs_by_nothing(rs, tiny_gemma, tmp_path, capsys):
    assert rs.main(["--model", str(tiny_gemma), "--tokens", "40", "--impls", "sdpa", "sdpa"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["max_abs_dlogprob"] == 0.0
    assert list(got["mean_abs_dlogprob_by_position"]) == ["1-16", "16-40"]


def test_two_implementations_and_the_results_file(rs, tiny_gemma, tmp_path):
    out = tmp_path / "out"
    assert rs.main(["--model", str(tiny_gemma), "--layers", "2", "--tokens", "300",
                    "--out", str(out)]) == 0  # fmt: skip
    got = json.loads((out / "rounding-sensitivity-cpu-tiny-gemma-2l.json").read_text())
    assert (got["layers"], got["vocab"], got["impls"]) == (2, 100, ["eager", "sdpa"])
    bands = got["mean_abs_dlogprob_by_position"]
    assert list(bands) == ["1-16", "16-64", "64-128", "128-256", "256-300"]
    assert all(v >= 0 for v in bands.values()) and got["max_abs_dlogprob"] < 50
    assert got["weights"] == {"std": 0.02, "seed": 4321, "norms": 1.0, "biases": 0.0}
    with pytest.raises(SystemExit):
        rs.main(["--model", str(tiny_gemma), "--tokens", "1"])
