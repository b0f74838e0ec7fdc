"""`fuselane bench serve`: end-to-end serving benchmark of one or more OpenAI-compatible endpoints.

Typical use, the two arms as two vLLM servers (or the canary ingress with an arm header):

    fuselane bench serve stock=http://127.0.0.1:8001 custom=http://127.0.0.1:8002 \\
        --request-rate 1 2 4 inf --num-prompts 200 --input-len 512 --output-len 128 \\
        --goodput ttft:500 tpot:50 --out results/serve

Every sweep point (request rate x max concurrency) runs against each endpoint in turn with the
same requests. Written to `--out`: `requests.jsonl` (the request log, one line per request),
`results.json` (arguments, versions, server info, one summary per run computed from the log),
`comparison.md` (each metric of each endpoint next to the baseline's, with the ratio) and, when
matplotlib is installed, `latency.png` and `throughput.png`.

This module holds the command line (`add_parser`, `build_parser`, `main`, `cmd_bench_serve`);
the rest is split by concern:
- `bench_serve_metrics`: `summarize` and the metric definitions (`vllm bench serve`'s);
- `bench_serve_sweep`: sweep points and `run_sweep`;
- `bench_serve_report`: results JSON, request log, comparison table, plots.
Their public names are re-exported here, the names callers have always used
(`bench_serve.summarize`, `bench_serve.load_request_log`, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fuselane.serving.bench_serve_metrics import (
    GOODPUT_KEYS,
    LATENCY_METRICS,
    METRIC_NAMES,
    input_tokens,
    output_tokens,
    parse_goodput,
    percentile,
    percentile_key,
    summarize,
)
from fuselane.serving.bench_serve_report import (
    comparison_table,
    load_request_log,
    server_info,
    versions,
    write_plots,
    write_results,
)
from fuselane.serving.bench_serve_sweep import Run, SweepOptions, SweepPoint, run_sweep
from fuselane.serving.datasets import (
    LengthSpec,
    LocalTokenizer,
    ServerTokenizer,
    Tokenizer,
    dataset_requests,
    load_dataset,
    synthetic_requests,
)
from fuselane.serving.loadgen import Endpoint, make_client, resolve_model, wait_ready

if TYPE_CHECKING:  # imported where requests are sent, so that `fuselane --help` needs no httpx
    import httpx

N = TypeVar("N", int, float)  # what a numeric option parses to

# The helper modules' public names stay importable from here: callers (the fuselane CLI, the
# end-to-end benchmarks, the tests) use `bench_serve.summarize`, `bench_serve.load_request_log`...
__all__ = [
    "DESCRIPTION",
    "GOODPUT_KEYS",
    "LATENCY_METRICS",
    "METRIC_NAMES",
    "Run",
    "SweepOptions",
    "SweepPoint",
    "add_parser",
    "build_parser",
    "cmd_bench_serve",
    "comparison_table",
    "configure_parser",
    "input_tokens",
    "load_request_log",
    "main",
    "output_tokens",
    "parse_goodput",
    "percentile",
    "percentile_key",
    "run_sweep",
    "server_info",
    "summarize",
    "versions",
    "write_plots",
    "write_results",
]


def _endpoint_spec(text: str) -> tuple[str, str]:
    label, sep, url = text.partition("=")
    if not sep:
        label, url = "", text
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"{text!r}: write LABEL=URL or URL with an http(s) URL, "
            "e.g. stock=http://127.0.0.1:8001"
        )
    if not label:
        label = url.split("://", 1)[1].rstrip("/")
    elif not all(c.isalnum() or c in "-_." for c in label):
        raise argparse.ArgumentTypeError(f"label {label!r}: use letters, digits, '-', '_', '.'")
    return label, url.rstrip("/")


def _header_spec(text: str) -> tuple[str | None, str, str]:
    left, sep, value = text.partition("=")
    label, colon, name = left.rpartition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r}: write NAME=VALUE (every endpoint) or LABEL:NAME=VALUE (one endpoint), "
            "e.g. custom:x-fuselane-arm=custom"
        )
    return (label if colon else None), name.strip(), value


def _number(text: str, parse: Callable[[str], N], ok: Callable[[N], bool], expected: str) -> N:
    """`parse(text)` if it parses and passes `ok`, else the usage error "'TEXT': EXPECTED"."""
    try:
        v: N | None = parse(text)
    except ValueError:
        v = None
    if v is None or not ok(v):
        raise argparse.ArgumentTypeError(f"{text!r}: {expected}")
    return v


def _rate(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "a request rate is a number > 0 or 'inf'")


def _positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "expected an integer >= 1")


def _positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "expected a number > 0")


def _percentile_arg(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v <= 100, "a percentile is a number from 0 to 100")


def _length(text: str) -> LengthSpec:
    try:
        return LengthSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _goodput_arg(text: str) -> str:
    try:
        parse_goodput([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


DESCRIPTION = """\
Load one or more OpenAI-compatible endpoints (vLLM servers, the fuselane canary ingress) with
streaming requests and report TTFT, TPOT, ITL, end-to-end latency, throughput and goodput with
the definitions of `vllm bench serve`, plus a comparison of every endpoint with the baseline.

Each ENDPOINT is LABEL=URL (or a bare URL), URL without /v1, e.g.
  fuselane bench serve stock=http://127.0.0.1:8001 custom=http://127.0.0.1:8002 \\
      --request-rate 2 4 inf --num-prompts 200 --input-len 256:1024 --output-len 128
For the canary ingress, give it twice with an arm header each:
  fuselane bench serve stock=http://127.0.0.1:8000 custom=http://127.0.0.1:8000 \\
      --header stock:x-fuselane-arm=stock --header custom:x-fuselane-arm=custom
A fixed-concurrency run: --request-rate inf --max-concurrency 8 (both take lists: the sweep
is every rate with every concurrency).
"""


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "endpoints",
        nargs="+",
        type=_endpoint_spec,
        metavar="ENDPOINT",
        help="LABEL=URL or URL, URL without /v1 (give endpoints before list options)",
    )
    g = p.add_argument_group("load")
    g.add_argument(
        "--num-prompts",
        type=_positive_int,
        default=100,
        metavar="N",
        help="requests per run (default 100)",
    )
    g.add_argument(
        "--request-rate",
        type=_rate,
        nargs="+",
        default=[math.inf],
        metavar="R",
        help="requests/s to sweep; 'inf' sends all at once (default inf)",
    )
    g.add_argument(
        "--burstiness",
        type=_positive_float,
        default=1.0,
        metavar="B",
        help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more even (default 1)",
    )
    g.add_argument(
        "--max-concurrency",
        type=_positive_int,
        nargs="+",
        default=[None],
        metavar="C",
        help="requests in flight at most, to sweep (default no cap)",
    )
    g.add_argument(
        "--max-duration",
        type=_positive_float,
        default=None,
        metavar="S",
        help="stop releasing requests S seconds into each run",
    )
    g.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help="a request is failed after S seconds (default 300)",
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="unmeasured requests per endpoint before the sweep (default 1)",
    )
    g.add_argument(
        "--ready-timeout",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="wait up to S seconds for each endpoint's /v1/models (default 60)",
    )
    g.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default 0)")
    g = p.add_argument_group("requests")
    g.add_argument(
        "--api",
        choices=("completions", "chat"),
        default="completions",
        help="streaming /v1/completions or /v1/chat/completions (default completions)",
    )
    g.add_argument(
        "--model", default=None, help="model name to request (default: the first each server lists)"
    )
    g.add_argument(
        "--header",
        type=_header_spec,
        action="append",
        default=[],
        metavar="[LABEL:]NAME=VALUE",
        help="extra request header (repeatable)",
    )
    g.add_argument(
        "--input-len",
        type=_length,
        default=None,
        metavar="N|LO:HI",
        help="prompt tokens, fixed or uniform over LO..HI (default 128)",
    )
    g.add_argument(
        "--output-len",
        type=_length,
        default=None,
        metavar="N|LO:HI",
        help="max tokens, fixed or uniform (default 128; with --dataset: the "
        "dataset's own lengths)",
    )
    g.add_argument(
        "--dataset",
        default=None,
        metavar="FILE",
        help="prompts from a .jsonl ({'prompt', 'output_tokens'} a line) or a ShareGPT .json file",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer.json or model dir for prompt lengths (default: the first "
        "server's /tokenize)",
    )
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let generation stop at EOS (default: exactly the asked length, vLLM's ignore_eos)",
    )
    g = p.add_argument_group("report")
    g.add_argument(
        "--goodput",
        nargs="+",
        type=_goodput_arg,
        default=[],
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)",
    )
    g.add_argument(
        "--percentiles",
        type=_percentile_arg,
        nargs="+",
        default=[50.0, 90.0, 99.0],
        metavar="P",
        help="latency percentiles (default 50 90 99)",
    )
    g.add_argument(
        "--baseline",
        default=None,
        metavar="LABEL",
        help="endpoint the others are compared with (default: 'stock' if given, else the first)",
    )
    g.add_argument(
        "--out",
        default="bench-serve-results",
        metavar="DIR",
        help="output folder (default ./bench-serve-results)",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=cmd_bench_serve)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on the `fuselane bench` subparsers (`parser.add_subparsers()`'s result);
    the handler is `args.func(args) -> int`."""
    p = subparsers.add_parser(
        "serve",
        help="end-to-end serving benchmark of OpenAI endpoints (stock vs custom)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return configure_parser(p)


def build_parser() -> argparse.ArgumentParser:
    """Standalone parser: `python -m fuselane.serving.bench_serve ...`."""
    return configure_parser(
        argparse.ArgumentParser(
            prog="fuselane bench serve",
            description=DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def _fail(msg: str) -> int:
    sys.stderr.write(f"fuselane bench serve: error: {msg}\n")
    return 2


def _endpoints_from_args(args: argparse.Namespace) -> list[Endpoint]:
    labels = [lb for lb, _ in args.endpoints]
    dup = sorted({lb for lb in labels if labels.count(lb) > 1})
    if dup:
        raise ValueError(f"endpoint label {dup[0]!r} is used twice: give each LABEL=URL once")
    headers: dict[str, dict[str, str]] = {lb: {} for lb in labels}
    for label, name, value in args.header:
        if label is not None and label not in headers:
            raise ValueError(
                f"--header names endpoint {label!r}, which is not one of: {', '.join(labels)}"
            )
        for lb in [label] if label is not None else labels:
            headers[lb][name] = value
    return [Endpoint(lb, url, args.model, headers[lb]) for lb, url in args.endpoints]


async def _tokenizer(
    args: argparse.Namespace, client: httpx.AsyncClient, ep: Endpoint, model: str
) -> Tokenizer | None:
    if args.tokenizer:
        return LocalTokenizer(args.tokenizer)
    tok = ServerTokenizer(client, ep.base_url, model, ep.headers)
    if await tok.available():
        return tok
    sys.stderr.write(
        f"note: {ep.label} has no /tokenize route and no --tokenizer was given: prompt lengths "
        "are approximate (the server's usage counts are still exact)\n"
    )
    return None


async def _bench(args: argparse.Namespace, endpoints: list[Endpoint], baseline: str) -> int:
    goodput = parse_goodput(args.goodput)
    points = [SweepPoint(rate, conc) for rate in args.request_rate for conc in args.max_concurrency]
    opts = SweepOptions(
        api=args.api,
        burstiness=args.burstiness,
        percentiles=args.percentiles,
        goodput=goodput,
        ignore_eos=args.ignore_eos,
        max_duration_s=args.max_duration,
        request_timeout_s=args.request_timeout,
        warmup=max(args.warmup, 0),
        seed=args.seed,
        progress=args.progress,
    )
    async with make_client(None, args.request_timeout) as client:
        info = {}
        for ep in endpoints:
            await wait_ready(client, ep, args.ready_timeout)
            info[ep.label] = await server_info(client, ep)
        first = endpoints[0]
        model = await resolve_model(client, first)
        tok = await _tokenizer(args, client, first, model)
        if args.dataset:
            requests = await dataset_requests(
                load_dataset(args.dataset), args.num_prompts, args.output_len, tok, args.seed
            )
        else:
            requests = await synthetic_requests(
                args.num_prompts,
                args.input_len or LengthSpec(128),
                args.output_len or LengthSpec(128),
                tok,
                args.seed,
            )
        runs = await run_sweep(endpoints, requests, points, opts, client)
    arg_record = {k: v for k, v in vars(args).items() if k != "func"}
    arg_record["endpoints"] = {ep.label: ep.base_url for ep in endpoints}
    arg_record["header"] = [list(h) for h in args.header]
    for k in ("input_len", "output_len"):
        arg_record[k] = str(arg_record[k]) if arg_record[k] is not None else None
    arg_record["request_rate"] = [r if math.isfinite(r) else "inf" for r in args.request_rate]
    paths = write_results(
        Path(args.out), runs, arg_record, info, baseline, args.percentiles, goodput
    )
    print(comparison_table(runs, baseline, args.percentiles, bool(goodput)))
    failed = sum(r.summary["failed"] for r in runs)
    if failed:
        print(f"{failed} request(s) failed; reasons are in {paths['results']} (errors)")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if "latency" not in paths:
        print("note: install matplotlib for latency.png and throughput.png")
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """The `fuselane bench serve` handler: 0 on success, 1 if a server fails us, 2 on usage."""
    try:
        endpoints = _endpoints_from_args(args)
    except ValueError as exc:
        return _fail(str(exc))
    labels = [ep.label for ep in endpoints]
    baseline = args.baseline or ("stock" if "stock" in labels else labels[0])
    if baseline not in labels:
        return _fail(f"--baseline {baseline!r} is not an endpoint label ({', '.join(labels)})")
    if args.dataset and args.input_len is not None:
        return _fail("--input-len and --dataset exclude each other: the dataset gives prompts")
    if args.dataset and not Path(args.dataset).is_file():
        return _fail(f"--dataset {args.dataset}: no such file")
    if args.tokenizer and not Path(args.tokenizer).exists():
        return _fail(f"--tokenizer {args.tokenizer}: no such file or directory")
    try:
        import httpx
    except ImportError:
        sys.stderr.write("fuselane bench serve needs httpx: pip install 'fuselane[serve]'\n")
        return 1
    try:
        return asyncio.run(_bench(args, endpoints, baseline))
    except (RuntimeError, ValueError, FileNotFoundError, httpx.HTTPError) as exc:
        sys.stderr.write(f"fuselane bench serve: {exc}\n")
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
