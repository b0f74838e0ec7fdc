"""The canary soak: the CPU canary under load for some minutes, with replica kills and a fault.

    python -m fuselane.benchmarks.soak.canary_soak --minutes 10 --clients 8 --out FILE.json

A local Ray on 127.0.0.1 and the CPU canary (`serving/configs/canary-cpu-tiny.yaml`: the tiny
model, stock vLLM against fuselane's kernels under Triton's interpreter). Stock's greedy answer
to every greedy request of the mix is taken first (pinned to stock). Then `--clients` clients
send completions and chats, streamed and whole, greedy and sampled, back to back, in two
phases:

1. `--minutes` of replica kills: every `--kill-every-s` a custom replica's process is killed
   (SIGKILL): the running one (waiting up to 30 s for it), else one still starting (up to 90 s
   for its process); Serve starts another. The custom arm must carry traffic across them all:
   a rollback here fails the run (a replica's crash is not the kernels' fault, and nothing in
   the run clears a rollback: an operator's action would hide it);
2. the fault, after the kills (a kill could hide it, and its rollback ends the custom arm's
   traffic for good): the custom arm is redeployed with `FUSELANE_FAULT_INJECT` (a kernel
   family's output corrupted on purpose, every call checked against the reference), and the
   load goes on until the canary rolls it back and `--after-fault-s` more (at most
   `--fault-phase-s`); then it is redeployed without the fault and stays rolled back (a
   redeploy is not the operator's word). `--fault none`: no fault phase.

`--kill-every-s 0 --fault none` is a healthy run: the canary under load, nothing done to it.

The figures (`report.figures`): sent, ok, failed with an error, lost, truncated as success,
wrong answers after a rollback and rollbacks not from the fault; the last four must be 0. The
JSON also holds the date, the machine, the versions, the config, every kill, what custom
answered between them, the fault and every rollback.
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
    p.add_argument("--minutes", type=float, default=10.0, help="the kill phase (default 10)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--out", type=Path, required=True, help="results JSON")
    p.add_argument("--config", type=Path, default=CONFIG, help="canary config (the CPU one)")
    p.add_argument("--model-dir", type=Path, help="tiny model folder (default: built in a tmp)")
    p.add_argument("--kill-every-s", type=float, default=120.0, help="custom kills; 0: none")
    p.add_argument("--fault", default="sampling", help="FUSELANE_FAULT_INJECT value, or none")
    p.add_argument("--after-fault-s", type=float, default=60.0, help="load after its rollback")
    p.add_argument("--fault-phase-s", type=float, default=300.0, help="the fault phase at most")
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
    """The run's timeline: the kill phase, then the fault phase; `events` for the JSON (times
    in seconds from the start of the load). Nothing here clears a rollback."""

    def __init__(self, args: argparse.Namespace, config: CanaryConfig, watch: Any) -> None:
        self.args, self.config, self.watch = args, config, watch
        self.start = time.time()
        self.kill_end = self.start + args.minutes * 60
        every = args.kill_every_s
        self.kill_marks = (
            [
                self.start + k * every
                for k in range(1, int(args.minutes * 60 // every) + 1)
                if k * every < args.minutes * 60
            ]
            if every > 0
            else []
        )
        self.with_fault = args.fault != "none"
        self.kills: list[dict[str, Any]] = []
        self.fault: dict[str, Any] = {}
        self._handled: set[float] = set()  # rollbacks the schedule has acted on

    def rel(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.start, 1)

    def done(self) -> bool:
        """The load may stop: the kills are over and the fault, if any, was caught and
        watched for `--after-fault-s` (or its phase ran out)."""
        now = time.time()
        if now < self.kill_end:
            return False
        if not self.with_fault:
            return True
        if "caught_at" in self.fault:
            return now >= self.fault["caught_at"] + self.args.after_fault_s
        return bool(self.fault) and now >= self.fault["injected_at"] + self.args.fault_phase_s

    def step(self) -> None:
        now = time.time()
        if self.kill_marks and now >= self.kill_marks[0]:
            mark = self.kill_marks.pop(0)
            rec = chaos.kill_custom_replica(APP, wait_running_s=30.0, wait_any_s=90.0)
            self.kills.append({**rec, "mark_s": self.rel(mark), "at_s": self.rel(rec["at"])})
            print(f"[soak] kill at {self.rel(rec['at'])}s: {rec}", flush=True)
        if self.with_fault and not self.fault and now >= self.kill_end:
            env = fault_env(self.config, self.args.fault)
            at = chaos.redeploy_custom(chaos.with_custom_env(self.config, env))
            self.fault = {"family": self.args.fault, "env": env, "injected_at": at}
            print(f"[soak] fault {self.args.fault} injected at {self.rel(at)}s", flush=True)
        for rb in self.watch.rollbacks:
            if rb["at"] not in self._handled:
                self._handled.add(rb["at"])
                self._on_rollback(rb)

    def _on_rollback(self, rb: dict[str, Any]) -> None:
        fault_live = bool(self.fault) and "caught_at" not in self.fault
        if fault_live and rb["at"] >= self.fault["injected_at"] and rb["reason"] in FAULT_REASONS:
            self.fault |= {"caught_at": rb["at"], "reason": rb["reason"]}
            self.fault["restored_at"] = chaos.redeploy_custom(self.config)
            print(f"[soak] fault caught ({rb['reason']}) at {self.rel(rb['at'])}s", flush=True)
            return
        # Any other rollback fails the run; it is left in force, as the canary decided.
        print(f"[soak] ROLLBACK not from the fault at {self.rel(rb['at'])}s: {rb}", flush=True)

    def unexpected_rollbacks(self) -> list[dict[str, Any]]:
        """Every rollback but the fault's: a healthy arm rolled back."""
        caught = self.fault.get("caught_at")
        return [rb for rb in self.watch.rollbacks if rb["at"] != caught]

    def rollback_spans(self) -> list[tuple[float, float]]:
        """When the custom arm was rolled back: from each rollback to the end of the run (the
        run never clears one)."""
        return [
            (rb["at"], float("inf")) for rb in sorted(self.watch.rollbacks, key=lambda r: r["at"])
        ]

    def fault_span(self) -> tuple[float, float] | None:
        if not self.fault:
            return None
        return (self.fault["injected_at"], self.fault.get("caught_at", float("inf")))

    def kill_intervals(self) -> list[tuple[float, float]]:
        """From each kill to the next one (the last: to the end of the kill phase)."""
        times = [k["at"] for k in self.kills if k.get("killed")]
        return list(zip(times, [*times[1:], self.kill_end][: len(times)], strict=True))

    def events(self) -> dict[str, Any]:
        fault = {k: v for k, v in self.fault.items() if k != "env"}
        for k in ("injected_at", "caught_at", "restored_at"):
            if k in fault:
                fault[f"{k[:-3]}_s"] = self.rel(fault[k])
        return {
            "kills": self.kills,
            "fault": fault,
            "rollbacks": [{**rb, "at_s": self.rel(rb["at"])} for rb in self.watch.rollbacks],
            "rollbacks_not_from_the_fault": [
                {**rb, "at_s": self.rel(rb["at"])} for rb in self.unexpected_rollbacks()
            ],
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
        kills = f"a kill every {args.kill_every_s:g}s" if args.kill_every_s > 0 else "no kills"
        print(f"[soak] load on: {args.minutes:g} min, {kills}, {args.clients} clients", flush=True)
        while not sched.done():
            sched.step()
            time.sleep(0.5)
        load_end = time.time()
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
        "minutes": args.minutes,  # the kill phase; the fault phase comes after it
        "load_s": round(load_end - sched.start, 1),
        "clients": args.clients,
        "kill_every_s": args.kill_every_s,
        "fault": args.fault,
        "after_fault_s": args.after_fault_s,
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
        figs=report.figures(
            records,
            refs,
            spans,
            sched.fault_span(),
            unexpected_rollbacks=len(sched.unexpected_rollbacks()),
            kill_intervals=sched.kill_intervals(),
            kill_phase=(sched.start, sched.kill_end),
        ),
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
    if args.fault != "none" and not out["events"]["fault"].get("caught_s"):
        bad["fault"] = "the fault was not rolled back"
    if bad:
        print(f"[soak] FAILED: {bad}", file=sys.stderr)
        return 1
    print(f"[soak] results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
