"""The end-to-end run's matrix options: model folders (`--model NAME`), workload sets
(`--workloads`), the long-decode count and `--kv-cache-dtype`, as plans; no engine starts.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks.test_e2e_script import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "e2e" / "run_e2e.py"
MODELS = REPO / "benchmarks" / "e2e" / "models"
GOLDEN = REPO / "benchmarks" / "results" / "golden-llama3-8b-h200-2026-11-26.json"

# The values written from the published configs (models/README.md), checked field by field:
# layers, hidden, intermediate, q heads, KV heads, head size, vocab, rope theta, max positions,
# sliding window, attention / final soft caps, tied embeddings, architecture.
EXPECTED: dict[str, tuple[Any, ...]] = {
    "llama-3-8b": (32, 4096, 14336, 32, 8, 128, 128256, 500000.0, 131072, None, None, None,
                   False, "LlamaForCausalLM"),
    "qwen2.5-1.5b": (28, 1536, 8960, 12, 2, 128, 151936, 1000000.0, 131072, None, None, None,
                     True, "Qwen2ForCausalLM"),
    "qwen2.5-7b": (28, 3584, 18944, 28, 4, 128, 152064, 1000000.0, 131072, None, None, None,
                   False, "Qwen2ForCausalLM"),
    "mistral-7b-v0.1": (32, 4096, 14336, 32, 8, 128, 32000, 10000.0, 32768, 4096, None, None,
                        False, "MistralForCausalLM"),
    "gemma-2-9b": (42, 3584, 14336, 16, 8, 256, 256000, 10000.0, 8192, 4096, 50.0, 30.0,
                   True, "Gemma2ForCausalLM"),
}  # fmt: skip


@pytest.fixture(scope="module")
def e2e():
    return load_script("run_e2e_matrix_under_test")


@pytest.fixture
def ws(e2e):
    """workload_sets, with settings restored afterwards (apply_shape writes into it, and the
    other e2e tests read the same module)."""
    settings = sys.modules["settings"]
    saved = {k: v for k, v in vars(settings).items() if k.isupper()}
    yield sys.modules["workload_sets"]
    for k, v in saved.items():
        setattr(settings, k, v)


def _cfg(name: str) -> dict[str, Any]:
    return json.loads((MODELS / name / "config.json").read_text())


def test_model_folders_hold_the_published_values(ws):
    assert ws.model_names() == sorted(EXPECTED)
    for name, want in EXPECTED.items():
        c = _cfg(name)
        f = ws.kernel_fields(c)
        got = (
            c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"],
            f["num_attention_heads"], f["num_key_value_heads"], f["head_size"], c["vocab_size"],
            c["rope_theta"], c["max_position_embeddings"], f["sliding_window"],
            f["attn_logit_softcapping"], f["final_logit_softcapping"],
            c.get("tie_word_embeddings", True), c["architectures"][0],
        )  # fmt: skip
        assert got == want, name
        assert c["torch_dtype"] == "bfloat16", name
        # config.json alone, as the earlier GPU runs' folder: no generation_config.json, whose
        # sampling defaults vLLM would apply to requests that leave them unset
        assert [p.name for p in (MODELS / name).iterdir()] == ["config.json"], name
    g = _cfg("gemma-2-9b")
    assert g["query_pre_attn_scalar"] == 256 and g["hidden_activation"] == "gelu_pytorch_tanh"


def test_default_model_is_the_golden_files_config(e2e):
    """The committed Llama folder is the config the golden file was written from (same sha256),
    so the default moved without changing any check's spec."""
    default = Path(e2e.parse_args([]).model)
    assert default == MODELS / "llama-3-8b"
    spec = json.loads(GOLDEN.read_text())["spec"]
    digest = hashlib.sha256((default / "config.json").read_bytes()).hexdigest()
    assert digest == spec["model_config_sha256"]
    assert e2e.golden.spec(default)["model_config_sha256"] == digest


def test_model_folders_load_with_transformers():
    transformers = pytest.importorskip("transformers")
    for name, want in EXPECTED.items():
        c = transformers.AutoConfig.from_pretrained(MODELS / name)
        assert type(c).__name__.removesuffix("Config") + "ForCausalLM" == want[-1], name
        assert (c.num_key_value_heads, c.vocab_size) == (want[4], want[6]), name
    gemma = transformers.AutoConfig.from_pretrained(MODELS / "gemma-2-9b")
    # vLLM 0.26's Gemma-2 reads the window per layer from layer_types: every other layer
    assert gemma.layer_types[:4] == ["sliding_attention", "full_attention"] * 2
    assert gemma.sliding_window == 4096 and gemma.head_dim == 256


def test_model_resolution(ws, e2e, tmp_path):
    assert ws.resolve_model("qwen2.5-1.5b") == MODELS / "qwen2.5-1.5b"
    assert ws.resolve_model(str(MODELS / "gemma-2-9b")) == MODELS / "gemma-2-9b"
    (tmp_path / "config.json").write_text("{}")
    assert ws.resolve_model(str(tmp_path)) == tmp_path  # any folder with a config.json
    with pytest.raises(ValueError, match=r"qwen2\.5-7b"):  # the message lists the names
        ws.resolve_model("qwen-nope")
    assert e2e.parse_args(["--model", "mistral-7b-v0.1"]).model == str(MODELS / "mistral-7b-v0.1")
    with pytest.raises(SystemExit):
        e2e.parse_args(["--model", "no-such-model"])


def test_default_set_keeps_todays_shape(ws):
    s = sys.modules["settings"]
    shape = ws.plan_shape("default", _cfg("llama-3-8b"))
    assert shape.workloads == tuple(s.WORKLOADS) and shape.adjustments == ()
    assert (shape.max_model_len, shape.prompt_id_range) == (8704, (100, 128000))
    assert shape.sampling == ws.Sampling(0.8, 50, 0.9, 1.0) and shape.kv_cache_dtype == "auto"
    assert shape.lone_prefill_lens == tuple(s.LONE_PREFILL_LENS)


def test_sets_shapes(ws):
    qwen = _cfg("qwen2.5-1.5b")
    s = ws.plan_shape("sampling", qwen)
    assert [(w.num_prompts, w.input_len, w.output_len) for w in s.workloads] == [(512, 128, 512)]
    assert s.sampling == ws.Sampling(0.8, 50, 0.95, repetition_penalty=1.1)
    assert ws.workload_set("sampling").arms == ("FLASH_ATTN_v1", "fuselane_all_v1")
    lp = ws.plan_shape("long-prompts", _cfg("qwen2.5-7b"))
    assert [w.name for w in lp.workloads] == ["8x16384-128"]
    assert lp.max_model_len == 16384 + 128 + ws.HEADROOM
    ld = ws.plan_shape("long-decode", _cfg("llama-3-8b"), long_decode_requests=8)
    assert [w.name for w in ld.workloads] == ["8x32768-1024"]
    assert ld.max_model_len == 32768 + 1024 + ws.HEADROOM and ld.adjustments == ()
    for name in ws.SET_NAMES:  # every request, correctness prompt and lone prefill fits
        for model in EXPECTED:
            sh = ws.plan_shape(name, _cfg(model))
            assert sh.max_model_len <= _cfg(model)["max_position_embeddings"]
            assert all(w.input_len + w.output_len <= sh.max_model_len for w in sh.workloads)
            assert max(sh.lone_prefill_lens) + 1 <= sh.max_model_len
            assert sh.prompt_id_range[1] <= _cfg(model)["vocab_size"]
    with pytest.raises(ValueError):
        ws.workload_set("nope")


def test_models_below_the_shape(ws):
    """Gemma-2's 8192 positions: the 8192-token prompts are shortened and the plan says so;
    Mistral's 32,000-token vocabulary bounds the prompt ids."""
    g = ws.plan_shape("default", _cfg("gemma-2-9b"))
    assert g.max_model_len == 8192
    assert [w.name for w in g.workloads][-1] == "16x7936-256"
    assert g.lone_prefill_lens[-1] == 8191 and any("16x7936-256" in a for a in g.adjustments)
    m = ws.plan_shape("default", _cfg("mistral-7b-v0.1"))
    assert m.prompt_id_range == (100, 32000) and m.max_model_len == 8704


def test_long_decode_rule(ws):
    assert ws.gpu_memory_mib({"memory": "81559 MiB"}) == 81559.0
    assert ws.gpu_memory_mib({"name": "unknown"}) is None
    assert ws.long_decode_requests(81559.0) == 8  # H100 80GB
    assert ws.long_decode_requests(143771.0) == 16  # H200
    assert ws.long_decode_requests(81559.0, tensor_parallel=2) == 16
    assert ws.long_decode_requests(None) == 16


def test_kv_cache_dtype_every_arm(ws, e2e):
    with pytest.raises(ValueError):
        ws.plan_shape("default", _cfg("llama-3-8b"), kv_cache_dtype="fp8_e5m2")
    ws.apply_shape(ws.plan_shape("default", _cfg("llama-3-8b"), kv_cache_dtype="fp8"))
    for arm in e2e.make_arms(["FLASH_ATTN", "fuselane", "TRITON_ATTN"]):
        assert e2e.engine_kwargs(arm, "/m")["kv_cache_dtype"] == "fp8"
        cmd = e2e.server_command(arm, "/m", 1)
        assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8"
    # a golden file written with the bf16 cache does not check an fp8 run
    was = json.loads(GOLDEN.read_text())
    assert any(
        "kv_cache_dtype" in d
        for d in e2e.golden.spec_differences(was, e2e.golden.spec(MODELS / "llama-3-8b"))
    )


def test_args_of_the_sets(e2e):
    a = e2e.parse_args(["--workloads", "sampling", "--model", "qwen2.5-1.5b"])
    assert a.arms == ["FLASH_ATTN_v1", "fuselane_all_v1"] and a.skip_online
    a = e2e.parse_args(["--workloads", "sampling", "--arms", "FLASH_ATTN", "fuselane_all"])
    assert a.arms == ["FLASH_ATTN", "fuselane_all"]  # --arms wins
    assert e2e.parse_args(["--workloads", "long-prompts"]).skip_online
    assert not e2e.parse_args([]).skip_online
    for bad in (["--workloads", "long-decode", "--golden", "write", "--golden-file", "g"],
                ["--workloads", "sampling", "--online-only"],
                ["--kv-cache-dtype", "int8"], ["--long-decode-requests", "0"]):  # fmt: skip
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)


def test_worker_command_carries_the_shape(e2e, ws, tmp_path, monkeypatch):
    seen = {}

    def fake_engine(cmd, env, log_path, result_path, timeout):
        seen["cmd"] = cmd
        log_path.write_text("")
        return {"status": "ok"}

    monkeypatch.setattr(e2e, "run_engine_process", fake_engine)
    args = e2e.parse_args(["--workloads", "long-decode", "--kv-cache-dtype", "fp8"])
    assert e2e.apply_run_shape(args) is not None  # the rule chose the count and says why
    e2e.run_arm_offline(e2e.make_arms(["fuselane"])[0], args, tmp_path, 10.0)
    cmd = seen["cmd"]
    for flag, value in (("--workloads", "long-decode"), ("--kv-cache-dtype", "fp8"),
                        ("--long-decode-requests", str(args.long_decode_requests)),
                        ("--model", str(MODELS / "llama-3-8b"))):  # fmt: skip
        assert cmd[cmd.index(flag) + 1] == value


def test_results_file_names_the_cell(e2e):
    def tag(**plan: Any) -> str:
        return sys.modules["report"].results_tag({"plan": plan})

    assert tag(model={"name": "llama-3-8b"}, workload_set="default", kv_cache_dtype="auto") == ""
    assert tag(model={"name": "llama8b"}) == ""  # the earlier folder's runs keep their names
    assert tag(model={"name": "qwen2.5-1.5b"}, workload_set="sampling") == "-qwen2.5-1.5b-sampling"
    assert tag(model={"name": "llama-3-8b"}, kv_cache_dtype="fp8") == "-kv-fp8"
    merged = {"runs": [{"plan": {"model": {"name": "gemma-2-9b"}}}]}
    assert sys.modules["report"].results_tag(merged) == "-gemma-2-9b"


def test_dry_run_of_a_cell(tmp_path):
    """The long-decode cell off the GPU: its plan, the set and the rule's note in the JSON."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--workloads", "long-decode",
         "--long-decode-requests", "8", "--out", str(tmp_path), "--no-results-copy"],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / ".no-such-dir")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((tmp_path / "e2e_results.json").read_text())["plan"]
    assert plan["workload_set"] == "long-decode" and plan["online"] == []
    assert [w["name"] for w in plan["workloads"]] == ["8x32768-1024"]
    assert plan["engine"]["max_model_len"] == 34048 and plan["model"]["name"] == "llama-3-8b"
    assert plan["sampling"]["repetition_penalty"] == 1.0


def test_documented_cells_parse(e2e):
    """Each matrix cell's command in docs/notes/e2e.md is one the script takes."""
    text = (REPO / "docs" / "notes" / "e2e.md").read_text()
    section = text.split("## The model and workload matrix", 1)[1]
    rows = re.findall(r"^\| [^|]+ \| `([^`]+)`", section, flags=re.MULTILINE)
    assert len(rows) == 9  # the matrix's cells
    sets = set()
    for row in rows:
        args = e2e.parse_args(shlex.split(row.split(" (")[0]))
        sets.add((Path(args.model).name, args.workloads, args.kv_cache_dtype))
    assert ("qwen2.5-1.5b", "sampling", "auto") in sets
    assert ("llama-3-8b", "default", "fp8") in sets and ("gemma-2-9b", "default", "auto") in sets
