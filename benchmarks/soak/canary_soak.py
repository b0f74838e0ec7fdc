"""The canary soak: the CPU canary under load for some minutes, with replica kills and a fault.

    python -m fuselane.benchmarks.soak.canary_soak --minutes 10 --clients 8 --out FILE.json

A local Ray on 127.0.0.1 and the CPU canary (`serving/configs/canary-cpu-tiny.yaml`: the tiny
model, stock vLLM against fuselane's kernels under Triton's interpreter). Stock's greedy answer
to every greedy request of the mix is taken first (pinned to stock). Then `--clients` clients
send completions and chats, streamed and whole, greedy and sampled, back to back, for
`--minutes`, while:

- every `--kill-every-s` a custom replica's process is killed (SIGKILL): the running one
  (waiting up to 30 s for it), else one still starting (up to 90 s for its process);
  Serve starts another;
- at `--fault-at` of the run the custom arm is redeployed with `FUSELANE_FAULT_INJECT` (a kernel
  family's output corrupted on purpose, every call checked against the reference), until the
  canary rolls it back; then it is redeployed without the fault, and stays rolled back (a
  redeploy is not the operator's word). Kills wait while the fault is live and not yet caught,
  so that a kill cannot hide it;
- a rollback for another reason (custom unavailable while its replica restarts: the error
  rule) is cleared as an operator would, with `fuselane canary weight`, once custom runs again.

The figures (`report.figures`): sent, ok, failed with an error, lost, truncated as success, and
wrong answers after a rollback; the last three must be 0. The JSON also holds the date, the
machine, the versions, the config, every kill, the fault and every rollback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fuselane.serving.canary import control
from fuselane.serving.canary.config import CanaryConfig, load_config, parse_config

from . import chaos, report
from .clients import Load, every_greedy_request, greedy_answers

CONFIG = Path(__file__).resolve().parents[2] / "serving" / "configs" / "canary-cpu-tiny.yaml"
APP = "canary-soak"
# The fault's rollback comes from what the fault breaks: answers (agreement) or checks.
FAULT_REASONS = ("agreement", "numerical_checks")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="canary_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="load duration (default 10)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--out", type=Path, required=True, help="results JSON")
    p.add_argument("--config", type=Path, default=CONFIG, help="canary config (the CPU one)")
    p.add_argument("--model-dir", type=Path, help="tiny model folder (default: built in a tmp)")
    p.add_argument("--kill-every-s", type=float, default=120.0, help="custom replica kills")
    p.add_argument("--fault", default="sampling", help="FUSELANE_FAULT_INJECT value")
    p.add_argument("--fault-at", type=float, default=0.4, help="fraction of the run (0.4)")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens per request")
    p.add_argument("--timeout-s", type=float, default=300.0, help="a client's wait: lost after")
    p.add_argument("--deploy-timeout", type=float, default=900.0, help="seconds for RUNNING")
    p.add_argument("--num-cpus", type=int, default=8, help="Ray's logical CPUs")
    p.add_argument("--raw", type=Path, help="also write every request's record here (JSON)")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def soak_config(args: argparse.Namespace, model_dir: Path) -> CanaryConfig:
    """The config file's canary, with this run's model, port and name."""
    data = load_config(args.config, check_paths=False).model_dump(mode="json")
    data["name"] = APP
    data["model"]["source"] = str(model_dir.resolve())
    data["http"] = {"host": "127.0.0.1", "port": _free_port()}
    return parse_config(data, f"{args.config} (soak)")


def fault_env(config: CanaryConfig, family: str) -> dict[str, str]:
    """The custom arm's environment with the fault on and every kernel call checked, so that
    the checks see it at the first request (the agreement rule needs mirrored pairs)."""
    return {
        **config.arms.custom.env,
        "FUSELANE_FAULT_INJECT": family,
        "FUSELANE_TELEMETRY": "1",
        "FUSELANE_TELEMETRY_CHECK_RATE": "1.0",
        "FUSELANE_TELEMETRY_FLUSH_S": "0.5",
    }


class Schedule:
    """The run's timeline: kills, the fault and its end, operator clears; `events` for the
    JSON (times in seconds from the start of the load)."""

    def __init__(self, args: argparse.Namespace, config: CanaryConfig, watch: Any) -> None:
        self.args, self.config, self.watch = args, config, watch
        self.start = time.time()
        self.end = self.start + args.minutes * 60
        self.kill_marks = [
            self.start + k * args.kill_every_s
            for k in range(1, int(args.minutes * 60 // args.kill_every_s) + 1)
            if k * args.kill_every_s < args.minutes * 60
        ]
        self.fault_at = self.start + args.fault_at * args.minutes * 60
        self.kills: list[dict[str, Any]] = []
        self.fault: dict[str, Any] = {}
        self.operator: list[dict[str, Any]] = []
        self._handled: set[float] = set()  # rollbacks the schedule has acted on

    def rel(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.start, 1)

    def fault_live(self) -> bool:
        return bool(self.fault) and "caught_at" not in self.fault

    def step(self) -> None:
        now = time.time()
        if self.kill_marks and now >= self.kill_marks[0] and not self.fault_live():
            mark = self.kill_marks.pop(0)
            rec = chaos.kill_custom_replica(APP, wait_running_s=30.0, wait_any_s=90.0)
            self.kills.append({**rec, "mark_s": self.rel(mark), "at_s": self.rel(rec["at"])})
            print(f"[soak] kill at {self.rel(rec['at'])}s: {rec}", flush=True)
        if not self.fault and now >= self.fault_at:
            env = fault_env(self.config, self.args.fault)
            at = chaos.redeploy_custom(chaos.with_custom_env(self.config, env))
            self.fault = {"family": self.args.fault, "env": env, "injected_at": at}
            print(f"[soak] fault {self.args.fault} injected at {self.rel(at)}s", flush=True)
        for rb in self.watch.rollbacks:
            if rb["at"] not in self._handled:
                self._on_rollback(rb)

    def _on_rollback(self, rb: dict[str, Any]) -> None:
        if self.fault_live() and rb["at"] >= self.fault["injected_at"]:
            if rb["reason"] in FAULT_REASONS:
                self._handled.add(rb["at"])
                self.fault |= {"caught_at": rb["at"], "reason": rb["reason"]}
                self.fault["restored_at"] = chaos.redeploy_custom(self.config)
                print(f"[soak] fault caught ({rb['reason']}) at {self.rel(rb['at'])}s", flush=True)
                return
        if "caught_at" in self.fault:
            self._handled.add(rb["at"])  # after the fault's rollback nothing is cleared
            return
        st = self.watch.last or {}
        if (st.get("replicas") or {}).get("custom", {}).get("running"):
            # Custom runs again: the operator's word clears an availability rollback.
            weight = rb.get("weight_before") or self.config.routing.weight
            control.set_weight(APP, weight, self.config.shadow.fraction)
            self._handled.add(rb["at"])
            now = time.time()
            self.operator.append(
                {"cleared_s": self.rel(rb["at"]), "at": now, "at_s": self.rel(now)}
            )
            print(f"[soak] operator cleared the rollback of {self.rel(rb['at'])}s", flush=True)

    def rollback_spans(self) -> list[tuple[float, float]]:
        """When the custom arm was rolled back: from each rollback to the operator's clear
        (or the end of the run)."""
        clears = sorted(o["at"] for o in self.operator)
        spans = []
        for rb in sorted(self.watch.rollbacks, key=lambda r: r["at"]):
            end = next((c for c in clears if c >= rb["at"]), float("inf"))
            spans.append((rb["at"], end))
        return spans

    def fault_span(self) -> tuple[float, float] | None:
        if not self.fault:
            return None
        return (self.fault["injected_at"], self.fault.get("caught_at", float("inf")))

    def events(self) -> dict[str, Any]:
        fault = {k: v for k, v in self.fault.items() if k != "env"}
        for k in ("injected_at", "caught_at", "restored_at"):
            if k in fault:
                fault[f"{k[:-3]}_s"] = self.rel(fault[k])
        return {
            "kills": self.kills,
            "fault": fault,
            "rollbacks": [{**rb, "at_s": self.rel(rb["at"])} for rb in self.watch.rollbacks],
            "operator_clears": self.operator,
            "status_changes": [{**s, "at_s": self.rel(s["at"])} for s in self.watch.snapshots],
            "status_errors": self.watch.errors[:10],
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from fuselane.serving.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="canary-soak-") as tmp:
        model_dir = args.model_dir or build_tiny_model(Path(tmp) / "tiny-model")
        return soak(args, Path(model_dir))


def soak(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """The run itself, on a model that exists; the results JSON's content."""
    import ray
    from ray import serve

    config = soak_config(args, model_dir)
    machine = report.machine()
    ray.init(
        num_cpus=args.num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level="ERROR",
        log_to_driver=False,
    )
    try:
        control.deploy(config, wait_s=args.deploy_timeout)
        url = f"http://127.0.0.1:{config.http.port}"
        refs = asyncio.run(greedy_answers(url, every_greedy_request(args.max_tokens)))
        watch = chaos.RollbackWatch(APP).start()
        sched = Schedule(args, config, watch)
        load = Load(url, args.clients, timeout_s=args.timeout_s, max_tokens=args.max_tokens)
        load.start()
        print(f"[soak] load on for {args.minutes:g} min, {args.clients} clients", flush=True)
        while time.time() < sched.end:
            sched.step()
            time.sleep(0.5)
        records = load.stop()
        time.sleep(2.0)  # the last outcomes reach the monitor
        watch.stop()
        status = control.status(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.raw:
        # Every record as it came, for a second look at the figures (not committed).
        rows = [{**vars(r), "request": vars(r.request)} for r in records]
        args.raw.write_text(json.dumps({"records": rows, "references": list(refs.items())}))
    spans = sched.rollback_spans()
    run_info = {
        "load_started_at": sched.start,  # time.time(); every `..._s` is counted from it
        "minutes": args.minutes,
        "clients": args.clients,
        "kill_every_s": args.kill_every_s,
        "fault": args.fault,
        "fault_at_fraction": args.fault_at,
        "max_tokens": args.max_tokens,
        "client_timeout_s": args.timeout_s,
        "config_file": str(args.config.name),
        "greedy_references": len(refs),
        # null: rolled back until the end of the run
        "rollback_spans_s": [[sched.rel(a), sched.rel(b) if b < 1e18 else None] for a, b in spans],
    }
    return report.results(
        run=run_info,
        config=config.model_dump(mode="json"),
        figs=report.figures(records, refs, spans, sched.fault_span()),
        detail=report.breakdown(records, refs),
        events=sched.events(),
        status=status,
        machine_at_start=machine,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    figs = out["figures"]
    print(json.dumps({k: v for k, v in figs.items() if not isinstance(v, dict)}, indent=1))
    bad = {k: v for k, v in out["must_be_zero"].items() if v}
    if bad or not out["events"]["fault"].get("caught_s"):
        print(f"[soak] FAILED: {bad or 'the fault was not rolled back'}", file=sys.stderr)
        return 1
    print(f"[soak] results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
