"""`fuselane bench kernels`' full grid: its case lists and keys, the ragged draws, the quick and
smoke grids the gate baselines were taken on, the split of the full grid into GPU calls that
docs/performance.md suggests, and the inputs every attention peer gets (ragged, fp8; CPU)."""

from __future__ import annotations

import enum
import json
import re
import shlex
import statistics
from collections import Counter
from pathlib import Path

import pytest
import torch

from fuselane.benchmarks.kernels import cli, grid

ROOT = Path(__file__).resolve().parents[2]
GEMMA = grid.MODELS["gemma-2-9b"]


def test_full_grid_sections_and_sizes():
    cases = grid.build_grid()
    counts = Counter((c.family, c.section) for c in cases)
    assert counts == {
        ("attention", "decode"): 55, ("attention", "decode_ragged"): 30,
        ("attention", "prefill"): 30, ("attention", "mixed"): 5,
        ("attention", "decode_fp8"): 55, ("attention", "decode_ragged_fp8"): 30,
        ("attention", "prefill_fp8"): 30, ("kv_cache", "kv_write"): 16,
        ("kv_cache", "kv_write_fp8"): 16, ("kv_cache", "rope_kv_write"): 12,
        ("sampling", "sampling"): 12,
    }  # fmt: skip
    llama = [c for c in cases if c.models == ("llama-3-8b",)]
    decode = [c.params for c in llama if c.section == "decode"]
    assert [p["batch"] for p in decode] == [1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256]
    assert [c.params for c in llama if c.section == "decode_fp8"] == decode
    # a whole Gemma-2-9B cache at each uniform batch fits 40 GiB, and twice the context would not
    budget = grid.KV_BUDGET_BYTES // GEMMA.kv_bytes_per_token
    for p in decode:
        tokens = p["batch"] * p["context"]
        assert tokens <= budget and (tokens * 2 > budget or p["context"] == 32768), p
    assert [c.params["seq_len"] for c in llama if c.section == "prefill"] == [
        1024, 2048, 4096, 8192, 16384, 32768,
    ]  # fmt: skip
    assert [c.params for c in llama if c.section == "prefill_fp8"] == [
        c.params for c in llama if c.section == "prefill"
    ]
    keys = {c.key for c in llama if c.section == "decode_ragged"}
    assert keys == {
        f"llama-3-8b B={b} ctx={d}"
        for b in (16, 48, 128)
        for d in ("loguniform(100,16384)", "chat-lognormal(1024,1)")
    }
    assert keys == {c.key for c in llama if c.section == "decode_ragged_fp8"}
    # bf16 sections first: a model's KV pool is made once per cache dtype
    order = [c.section for c in llama if c.family == "attention"]
    assert order.index("decode_fp8") > max(i for i, s in enumerate(order) if s == "mixed")


def test_ragged_draws_are_fixed_and_shared():
    for dist in grid.RAGGED_DISTS.values():
        for batch in grid.RAGGED_BATCHES:
            lens = dist.draw(batch)
            assert lens == dist.draw(batch) and len(lens) == batch
            assert all(dist.lo <= n <= dist.hi for n in lens)
    # pinned: a change of the draw renames nothing, so it must fail here instead
    summary = {
        name: [(min(x), statistics.median(x), max(x), sum(x)) for x in [d.draw(48), d.draw(128)]]
        for name, d in grid.RAGGED_DISTS.items()
    }
    assert summary == {
        "loguniform": [(107, 2617.0, 15711, 204329), (106, 1134.5, 16376, 400679)],
        "chat": [(184, 923.0, 14804, 85167), (68, 1074.0, 16384, 200130)],
    }
    # every model's case (and the fp8 one) draws the same lengths
    draws = {
        (c.params["batch"], c.dist.label): c.contexts
        for c in grid.build_grid(("attention",))
        if c.section in grid.RAGGED_SECTIONS
    }
    assert len(draws) == 6
    for c in grid.build_grid(("attention",)):
        if c.section in grid.RAGGED_SECTIONS:
            assert c.contexts == draws[(c.params["batch"], c.dist.label)]


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_quick_grid_keeps_the_gate_baselines_cases(gpu):
    baseline = json.loads((ROOT / f"benchmarks/results/baseline-kernels-{gpu}.json").read_text())
    measured = {(r["section"], r["case"]) for r in baseline["results"]}
    assert {(c.section, c.key) for c in grid.build_grid(grid="quick")} == measured


def test_quick_and_smoke_pools_keep_their_size():
    """The pool's size sets the random page permutation of every case: the gate's inputs."""
    from fuselane.benchmarks.kernels.attention_cases import pool_pages

    assert (pool_pages("quick"), pool_pages("smoke")) == (16448, 73)


def test_smoke_grid_is_unchanged():
    keys = [(c.section, c.key) for c in grid.build_grid(grid="smoke")]
    assert keys == [
        ("decode", "tiny B=2 ctx=40"), ("prefill", "tiny S=48"),
        ("mixed", "tiny 1x24 prefill + 2 decode, ctx=40"), ("prefill_fp8", "tiny S=48"),
        ("kv_write", "tiny tokens=5"),
        ("kv_write_fp8", "tiny tokens=5"), ("rope_kv_write", "tiny tokens=5"),
        ("sampling", "tiny B=2 V=1000"),
    ]  # fmt: skip


def test_section_selection(capsys):
    cases = grid.build_grid(("attention",), ("qwen-2.5-7b",), sections=("prefill", "mixed"))
    assert [c.label for c in cases][-2:] == ["S=32768", "4x512 prefill + 60 decode, ctx=4096"]
    with pytest.raises(ValueError, match="section 'x': expected one of decode"):
        grid.build_grid(sections=("x",))
    assert cli.main(["--list", "--section", "decode_ragged", "--model", "gemma-2-9b"]) == 0
    out = capsys.readouterr().out
    assert "gemma-2-9b B=48 ctx=chat-lognormal(1024,1)" in out and "6 cases, ~" in out
    assert cli.main(["--list", "--family", "sampling", "--section", "decode"]) == 2
    assert "belongs to family attention" in capsys.readouterr().err
    assert cli.main(["--quick", "--section", "decode_fp8", "--out", "/nonexistent"]) == 2
    assert "the quick grid has no case in section(s) decode_fp8" in capsys.readouterr().err


def _split_commands() -> list[tuple[list[str], int, int]]:
    """docs/performance.md's `# part i/n: N cases, ~S s` lines: (arguments, N, S)."""
    text = (ROOT / "docs/performance.md").read_text()
    parts = []
    for line in text.splitlines():
        m = re.search(r"# part \d/\d: (\d+) cases, ~(\d+) s", line)
        if m:
            parts.append((shlex.split(line.split("#")[0])[3:], int(m[1]), int(m[2])))
    return parts


def test_the_documented_split_covers_the_full_grid_once_within_a_call():
    """docs/performance.md's parts: every full-grid case in exactly one, each within ~9 min, and
    the counts and estimates the lines give are the grid's."""
    parts = _split_commands()
    assert len(parts) == 6
    seen: Counter = Counter()
    for argv, count, seconds in parts:
        parser = cli.argparse.ArgumentParser()
        cli.add_parser(parser.add_subparsers())
        args = parser.parse_args(["kernels", *argv])
        grid_name, families, sections = cli._selection(args)
        cases = grid.build_grid(families, tuple(args.model or ()) or None, grid_name, sections)
        seen.update((c.section, c.key) for c in cases)
        estimate = grid.RUN_START_S + sum(grid.estimate_s(c) for c in cases)
        assert (len(cases), round(estimate)) == (count, seconds), argv
        assert estimate <= 0.85 * args.budget and args.budget + 60 <= 540, argv
    assert set(seen) == {(c.section, c.key) for c in grid.build_grid()}
    assert set(seen.values()) == {1}


class KVQuantMode(enum.IntEnum):
    """Stands in for vLLM's enum: the wrapper takes it from the kernel's module (this one)."""

    NONE = 0
    FP8_PER_TENSOR = 1


# Triton's interpreter converts 1-element arrays to scalars, which numpy deprecates (noise)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_peers_get_the_same_ragged_fp8_inputs():
    """One ragged fp8 case under the interpreter: fuselane matches the reference, and vLLM's and
    FlashInfer's wrappers (stand-ins recording their calls) get the same lengths, pages and
    scales."""
    from fuselane.benchmarks.kernels import attention_cases
    from fuselane.benchmarks.kernels.impls import Context, bench_scripts_on
    from fuselane.benchmarks.kernels.peers import Peers

    calls: dict[str, dict] = {}

    def unified_attention(q, k, v, out, *, seqused_k, block_table, k_descale, v_descale,
                          kv_quant_mode=KVQuantMode.NONE, **kw):  # fmt: skip
        calls["vllm"] = dict(lens=seqused_k.tolist(), table=block_table, k=k, mode=kv_quant_mode,
                             k_descale=k_descale, v_descale=v_descale)  # fmt: skip

    class Wrapper:
        def __init__(self, workspace, layout, use_tensor_cores=False):
            self.tensor_cores = use_tensor_cores

        def plan(self, indptr, indices, last_page_len, *shape, **options):
            calls["fi_plan"] = dict(indptr=indptr, indices=indices, last=last_page_len, **options)

        def run(self, q, kv, out, **scales):
            calls["fi_run"] = dict(kv=kv, **scales)

    class FlashInfer:
        BatchDecodeWithPagedKVCacheWrapper = Wrapper

    dist = grid.ContextDist("loguniform", 8, 80, 8, 80)
    case = grid.Case("attention", "decode_ragged_fp8", ("tiny",), grid.SMOKE_MODEL, (2,), dist)
    lens = case.contexts
    peers = Peers(frozenset({"vllm", "flashinfer"}), unified_attention, None, FlashInfer())
    notes: list[str] = []
    ctx = Context(torch.device("cpu"), peers, "smoke", notes.append)
    with bench_scripts_on(torch.device("cpu")):
        prep = attention_cases.prepare(ctx, case)
        assert [i.name for i in prep.impls] == ["fuselane", "vllm-triton-unified", "flashinfer"]
        assert prep.impls[2].warm.endswith("kv=fp8")
        results = {}
        for impl in prep.impls:
            fn, check = impl.setup()
            fn()
            results[impl.name] = check
        ok, detail = results["fuselane"]()
    assert ok, detail
    assert prep.extra["cache_dtype"] == "float8_e4m3fn" and prep.extra["contexts"] == lens
    assert prep.extra["ctx_sum"] == sum(lens) and prep.extra["ctx_seed"] == dist.seed(2)
    v, fi, plan = calls["vllm"], calls["fi_run"], calls["fi_plan"]
    assert v["lens"] == lens and v["k"].dtype == torch.float8_e4m3fn
    assert v["mode"] is KVQuantMode.FP8_PER_TENSOR
    assert v["k_descale"].shape == (2, grid.SMOKE_MODEL.num_kv_heads)
    assert torch.all(v["k_descale"] == 0.37) and torch.all(v["v_descale"] == 0.61)
    # FlashInfer: the same pages, in indptr form, and the scales as floats
    pages = [(n + grid.PAGE - 1) // grid.PAGE for n in lens]
    assert plan["indptr"].tolist() == [0, pages[0], sum(pages)]
    assert (
        plan["indices"].tolist()
        == v["table"][0, : pages[0]].tolist() + v["table"][1, : pages[1]].tolist()
    )
    assert plan["last"].tolist() == [
        n - (p - 1) * grid.PAGE for n, p in zip(lens, pages, strict=True)
    ]
    assert plan["kv_data_type"] == torch.float8_e4m3fn and fi["kv"].dtype == torch.float8_e4m3fn
    assert fi["k_scale"] == pytest.approx(0.37) and fi["v_scale"] == pytest.approx(0.61)


def test_parts_merge_into_one_report_with_the_best_peer(tmp_path):
    from fuselane.benchmarks.kernels import outputs

    def part(section: str, rows: list[tuple[str, float, bool]], device="NVIDIA H100") -> dict:
        base = dict(section=section, case="m B=1 ctx=8", models="m", label="B=1 ctx=8",
                    family="attention", nbytes=4e6)  # fmt: skip
        results = [
            {**base, "impl": impl, "us": us, "check_ok": ok}
            | ({} if impl == "fuselane" else {"peer_over_fuselane": us / rows[0][1]})
            for impl, us, ok in rows
        ]
        return {"benchmark": "kernels", "device": device, "date": "2026-11-27", "grid": "full",
                "torch": "2.11", "triton": "3.6", "elapsed_s": 100.0, "ceilings": {},
                "families": ["attention"], "sections": [section], "models": {},
                "failures": [], "skipped": [f"{section} x: time budget spent"], "notes": [],
                "results": results}  # fmt: skip

    a = part("decode", [("fuselane", 2.0, True), ("vllm", 3.0, True), ("flashinfer", 1.0, False)])
    b = part("decode_fp8", [("fuselane", 1.0, True), ("flashinfer", 1.5, True)])
    files = []
    for name, payload in (("a.json", a), ("b.json", b)):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps(payload))
    assert cli.main(["--merge", *map(str, files), "--out", str(tmp_path / "m")]) == 0
    (path,) = (tmp_path / "m").glob("kernels-h100-2026-11-27.json")
    merged = json.loads(path.read_text())
    assert len(merged["results"]) == 5 and merged["elapsed_s"] == 200.0
    assert [p["file"] for p in merged["parts"]] == ["a.json", "b.json"]
    assert len(merged["skipped"]) == 2
    md = path.with_suffix(".md").read_text()
    # the fastest peer whose output matched: FlashInfer's differed, so vLLM's
    assert "| m | B=1 ctx=8 | 2.00 |" in md and "| vllm (1.50x) |" in md
    assert "| flashinfer (1.50x) |" in md
    with pytest.raises(ValueError, match="different GPU models"):
        outputs.merge([a, part("decode", [], device="NVIDIA H200")], ["a", "c"])
    # a merge merged again (a `--gpus` run with another part): its parts are listed, each
    # under the merged file's name
    c = part("prefill", [("fuselane", 5.0, True)])
    again = outputs.merge([merged, c], ["gpus.json", "c.json"])
    assert [p["file"] for p in again["parts"]] == ["gpus.json: a.json", "gpus.json: b.json",
                                                   "c.json"]  # fmt: skip
    assert again["parts"][2]["elapsed_s"] == 100.0 and len(again["results"]) == 6


@pytest.mark.parametrize("sweep", ["decode_split_sweep", "prefill_ws_sweep"])
def test_sweeps_take_head_size_64_outside_the_grid(sweep, tmp_path):
    """The launch-rule sweeps time a head-size-64 model the grid does not carry: the name
    parses (the run then stops at the missing GPU, not at argparse's exit status 2)."""
    import importlib

    m = grid.SWEEP_MODELS["llama-3.2-1b"]
    assert (m.num_q_heads, m.num_kv_heads, m.head_size) == (32, 8, 64)
    assert "llama-3.2-1b" not in grid.MODELS
    assert all(grid.SWEEP_MODELS[name] is shape for name, shape in grid.MODELS.items())
    main = importlib.import_module(f"fuselane.benchmarks.kernels.{sweep}").main
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--out", str(tmp_path), "--model", "llama-3.2-1b"])
