"""benchmarks/fuzz/: the kernel fuzzer under Triton's interpreter. The command line on a few small
cases per family and its JSON; a case rerun alone by its index; the time limit; and a
deliberately wrong kernel of each family reported as a mismatch for exactly the cases it
corrupted (a fuzzer that cannot fail checks nothing)."""

from __future__ import annotations

import json
import random
import shlex
import subprocess
import sys

import pytest
import torch

from fuselane.benchmarks.fuzz import attention, core, kernel_fuzz, kv_cache, sampling
from fuselane.benchmarks.fuzz.sampling_checks import PIT_MIN_SAMPLES, distribution_check
from fuselane.kernels import attention as attn
from fuselane.kernels import kv_cache as kvc
from fuselane.kernels import sampling as smp

# The interpreter evaluates both sides of tl.where with numpy: its warnings are noise here.
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

CASES = 4
SEED = 7
FAMILIES = {"attention": attention.FAMILY, "kv_cache": kv_cache.FAMILY, "sampling": sampling.FAMILY}


def _configs(name: str, seed: int, cases: int) -> list[dict]:
    """The configurations a run draws (the same functions as the run, no kernel called)."""
    family = FAMILIES[name]
    pool = core.profile_pool(family, seed, family.default_profiles["small"], "small")
    return [core.draw_case(family, seed, i, pool, "small") for i in range(cases)]


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("fuzz") / "fuzz.json"
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "fuselane.benchmarks.fuzz.kernel_fuzz",
         "--family", "all", "--cases", str(CASES), "--seed", str(SEED), "--out", str(out),
         "--progress-every", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return proc, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.timeout(300)
def test_cli_checks_every_family_and_writes_the_json(cli):
    proc, payload = cli
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert payload["ok"] is True and payload["interpret"] is True
    assert payload["scale"] == "small" and payload["device"] == "cpu" and payload["seed"] == SEED
    assert set(payload["families"]) == set(FAMILIES)
    for name, fam in payload["families"].items():
        assert fam["ok"] and fam["cases_run"] == fam["cases_requested"] == CASES, name
        assert fam["passed"] + fam["refused_count"] == CASES, name
        assert fam["mismatched_count"] == fam["errors_count"] == 0, name
        assert fam["mismatched"] == fam["errors"] == [] and fam["aborted"] is None
        assert fam["compile_variants"] == {} and fam["new_compiles"] == 0  # nothing compiles
        assert len(fam["profiles"]) == FAMILIES[name].default_profiles["small"]
        assert fam["wall_s"] > 0 and not fam["stopped_by_time_limit"]
        assert all(r["count"] >= 1 and r["message"] for r in fam["refused"].values())
        assert f"[{name}] 2/{CASES} cases" in proc.stdout  # progress
    stats = {name: fam["stats"] for name, fam in payload["families"].items()}
    assert stats["attention"]["query_rows"] >= 0 and "workspace" in stats["attention"]
    assert "tokens" in stats["kv_cache"]
    assert stats["sampling"]["rows"] >= 1
    assert "unseeded_draws" in payload["families"]["sampling"]["checks"]


def test_configurations_are_a_function_of_seed_and_index():
    """A case drawn alone (`--index`) is the case the run drew, and its record's command line
    reruns it."""
    for name, family in FAMILIES.items():
        configs = _configs(name, SEED, 5)
        assert configs == _configs(name, SEED, 5)
        pool = core.profile_pool(family, SEED, family.default_profiles["small"], "small")
        assert core.draw_case(family, SEED, 3, pool, "small") == configs[3]
        assert configs != _configs(name, SEED + 1, 5)
        json.dumps(configs)  # JSON-able: failures carry their configuration
    line = core.repro_command("sampling", 9, 1234, 6, "small")
    args = kernel_fuzz.parse_args(shlex.split(line)[3:])
    assert (args.family, args.seed, args.index, args.profiles) == ("sampling", 9, "1234", 6)
    args = kernel_fuzz.parse_args(["--sanitizer-set"])
    assert (args.scale, args.cases) == ("sanitizer", kernel_fuzz.SANITIZER_CASES)
    for family in FAMILIES.values():  # the sanitizer set's draws are well formed
        pool = core.profile_pool(family, 0, family.default_profiles["sanitizer"], "sanitizer")
        json.dumps([core.draw_case(family, 0, i, pool, "sanitizer") for i in range(20)])


def test_profile_pools_cover_the_supported_sets():
    """The default pools of a GPU run hold every choice of every dimension at least once."""
    full = {
        n: core.profile_pool(f, 0, f.default_profiles["full"], "full") for n, f in FAMILIES.items()
    }
    pool = full["attention"]
    assert {p["head_size"] for p in pool} == set(attn.SUPPORTED_HEAD_SIZES)
    assert {p["block_size"] for p in pool} == set(attn.SUPPORTED_BLOCK_SIZES)
    assert {tuple(p["heads"]) for p in pool} == {(32, 8), *attention.HEADS["full"]}
    assert {p["window"] for p in pool} == set(attention.WINDOWS["full"])
    assert pool[0]["head_size"] == 128 and pool[0]["kv"] == "same"  # the Hopper kernels' profile
    pool = full["kv_cache"]
    assert {p["kv_heads"] for p in pool} == set(kv_cache.KV_HEADS["full"])
    assert {p["layout"] for p in pool} == set(kv_cache.CACHE_LAYOUTS)
    assert {p["op"] for p in pool} == {"write", "rope"}
    pool = full["sampling"]
    assert {p["vocab"] for p in pool} == set(sampling.VOCABS["full"])
    assert {p["logprobs"] for p in pool} == set(sampling.LOGPROB_CLASSES)
    assert {p["mode"] for p in pool} == set(smp.LOGPROBS_MODES)


def test_time_limit_stops_drawing(tmp_path):
    out = tmp_path / "limited.json"
    rc = kernel_fuzz.main(["--family", "kv_cache", "--cases", "50", "--time-limit", "0",
                           "--out", str(out)])  # fmt: skip
    fam = json.loads(out.read_text())["families"]["kv_cache"]
    assert rc == 0 and fam["cases_run"] == 0 and fam["stopped_by_time_limit"]


# ----------------------------------------------------------------------------------------------
# A wrong kernel is caught
# ----------------------------------------------------------------------------------------------


def _nudge(t: torch.Tensor) -> None:
    """Change one element of `t` for sure: NaN becomes 0, a number grows by one."""
    x = t[(0,) * (t.dim() - 1)][:1]
    x.copy_(torch.where(torch.isnan(x), 0.0, x + 1.0))


def _flip(t: torch.Tensor) -> None:
    """Flip the low bit of `t`'s first element (fp8 included)."""
    x = t[(0,) * (t.dim() - 1)][:1]
    core.bits(x).bitwise_xor_(1)


def _wrong(real, corrupt):
    def call(*args, **kwargs):
        result = real(*args, **kwargs)
        corrupt(args, kwargs, result)
        return result

    return call


def _out_row(kwargs: dict, row_of) -> None:
    out = kwargs["out"]
    row = row_of(kwargs)
    if row < out.shape[0]:
        _nudge(out[row])


WRONG = {
    # (family, entry points, corruption, cases it makes detectable)
    "attention-value": (
        "attention", (attn, ("paged_attention", "paged_attention_unchecked")),
        lambda a, kw, r: _out_row(kw, lambda kw: 0),
        lambda c: sum(c["q_lens"]) + c["pad_rows"] > 0,
    ),
    "attention-padding-row": (
        "attention", (attn, ("paged_attention", "paged_attention_unchecked")),
        lambda a, kw, r: _out_row(kw, lambda kw: int(kw["cu_seqlens_q"][-1])),
        lambda c: c["pad_rows"] > 0,
    ),
    "kv_cache-bit": (
        "kv_cache", (kvc, ("kv_cache_update", "kv_cache_update_unchecked",
                           "rope_kv_cache_update")),
        lambda a, kw, r: _flip(a[2] if len(a) < 9 else a[6]),
        lambda c: True,
    ),
    "sampling-nan-count": (
        "sampling", (smp, ("fused_sample",)),
        lambda a, kw, r: r.nan_rows[:1].add_(1),
        lambda c: True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_a_wrong_kernel_is_a_mismatch(wrong, monkeypatch, tmp_path):
    name, (module, entries), corrupt, detectable = WRONG[wrong]
    for entry in entries:
        monkeypatch.setattr(module, entry, _wrong(getattr(module, entry), corrupt))
    out = tmp_path / "wrong.json"
    rc = kernel_fuzz.main(["--family", name, "--cases", str(CASES), "--seed", str(SEED),
                           "--out", str(out), "--progress-every", "0"])  # fmt: skip
    fam = json.loads(out.read_text())["families"][name]
    configs = _configs(name, SEED, CASES)
    refused = FAMILIES[name].expected_refusal
    want = {i for i, c in enumerate(configs) if refused(c) is None and detectable(c)}
    assert want, "no case this corruption can show: choose another seed"
    assert rc == 1 and not fam["ok"] and fam["errors_count"] == 0
    assert {m["index"] for m in fam["mismatched"]} == want
    assert fam["passed"] + fam["refused_count"] == CASES - len(want)
    for m in fam["mismatched"]:
        assert m["kind"] == "wrong output" and m["first_mismatch"]
        assert f"--index {m['index']}" in m["repro"] and m["config"] == configs[m["index"]]


def test_a_wrong_sampler_draw_is_a_mismatch(monkeypatch, tmp_path):
    """Tokens moved to the next id: the greedy and seeded rows give it away."""

    def shift(a, kw, r):
        r.token_ids.copy_((r.token_ids + 1) % a[0].shape[1])

    monkeypatch.setattr(smp, "fused_sample", _wrong(smp.fused_sample, shift))
    out = tmp_path / "wrong.json"
    rc = kernel_fuzz.main(["--family", "sampling", "--cases", str(CASES), "--seed", str(SEED),
                           "--out", str(out), "--progress-every", "0"])  # fmt: skip
    fam = json.loads(out.read_text())["families"]["sampling"]
    assert rc == 1 and fam["mismatched_count"] >= 1 and fam["errors_count"] == 0
    assert "token_ids" in fam["mismatched"][0]["first_mismatch"]


def test_distribution_check_fails_a_biased_sampler():
    """The unseeded rows' PIT values: uniform passes, a sampler favouring low token ids (u
    skewed towards 0) fails, too few draws are not tested."""
    rng = random.Random(0)
    uniform = [rng.random() for _ in range(5000)]
    assert distribution_check({"pit": uniform})["unseeded_draws"]["ok"]
    skewed = distribution_check({"pit": [u**1.2 for u in uniform]})["unseeded_draws"]
    assert skewed["tested"] and not skewed["ok"]
    few = distribution_check({"pit": uniform[: PIT_MIN_SAMPLES - 1]})["unseeded_draws"]
    assert few == {"samples": PIT_MIN_SAMPLES - 1, "tested": False, "ok": True}
