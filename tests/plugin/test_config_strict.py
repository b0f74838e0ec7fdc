"""The plugin's variables are refused when they cannot work, each error naming the variable, the
value and what it takes; the metrics port binds loopback unless a host is given; a process
whose Triton cannot interpret the kernels is refused at register(), not at the first request."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fuselane.plugin.config import (
    FAULT_INJECT_ENV_VAR,
    FuselaneConfigError,
    host_problem,
    interpreter_problem,
    parse_fault_inject,
    parse_kernels,
)
from fuselane.plugin.telemetry_config import (
    TelemetryConfig,
    TelemetryConfigError,
    parse_port,
)


@pytest.mark.parametrize("bad", ["all,none", "none,kv_cache", "attn", "attention,bogus"])
def test_fault_inject_refuses_what_kernels_refuses(bad):
    with pytest.raises(FuselaneConfigError):
        parse_kernels(bad)
    with pytest.raises(FuselaneConfigError) as e:
        parse_fault_inject(bad)
    msg = str(e.value)
    assert msg.startswith(f"{FAULT_INJECT_ENV_VAR}={bad!r}")
    assert "valid values: attention, kv_cache, sampling, all, none" in msg
    assert e.value.variable == FAULT_INJECT_ENV_VAR


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("FUSELANE_TELEMETRY_GRAPH_PROBE_EVERY", "2.7", "an integer >= 1"),
        ("FUSELANE_TELEMETRY_GRAPH_PROBE_EVERY", "1e3", "an integer >= 1"),
        ("FUSELANE_TELEMETRY_FLUSH_S", "1e300", "a number of seconds in [0.01, 3600]"),
        ("FUSELANE_TELEMETRY_FLUSH_S", "3600.5", "a number of seconds in [0.01, 3600]"),
        ("FUSELANE_TELEMETRY_FLUSH_S", "0", "a number of seconds in [0.01, 3600]"),
        ("FUSELANE_TELEMETRY_TIMING_RATE", "nan", "a fraction in [0, 1]"),
        ("FUSELANE_TELEMETRY_PORT", "no such host!:9400", "neither an IP address nor a host"),
        ("FUSELANE_TELEMETRY_PORT", "999.1.1.1:9400", "not a valid IP address"),
        ("FUSELANE_TELEMETRY_PORT", "::1:9400", "HOST:PORT"),
        ("FUSELANE_TELEMETRY_PORT", "localhost:0", "PORT (1-65535"),
    ],
)
def test_bad_telemetry_values_name_variable_value_and_range(name, raw, expected):
    with pytest.raises(TelemetryConfigError) as e:
        TelemetryConfig.from_env({name: raw})
    msg = str(e.value)
    assert msg.startswith(f"{name}={raw!r}: ") and expected in msg, msg
    assert e.value.variable == name


def test_telemetry_numbers_in_range_are_kept():
    cfg = TelemetryConfig.from_env(
        {"FUSELANE_TELEMETRY_GRAPH_PROBE_EVERY": " 7 ", "FUSELANE_TELEMETRY_FLUSH_S": "3600"}
    )
    assert cfg.graph_probe_every == 7 and isinstance(cfg.graph_probe_every, int)
    assert cfg.flush_interval_s == 3600.0


@pytest.mark.parametrize(
    ("raw", "bound"),
    [
        ("19411", ("127.0.0.1", 19411)),  # no host: this machine only
        (" 9400 ", ("127.0.0.1", 9400)),
        ("0.0.0.0:9400", ("0.0.0.0", 9400)),  # every interface, when asked for
        ("metrics-1.example.com:9400", ("metrics-1.example.com", 9400)),
        ("[::1]:9400", ("::1", 9400)),
        ("", None),
    ],
)
def test_metrics_port_binds_loopback_unless_a_host_is_given(raw, bound):
    assert parse_port(raw) == bound
    env = {"FUSELANE_TELEMETRY_PORT": raw} if raw else {}
    assert TelemetryConfig.from_env(env).port == bound


def test_host_check():
    for ok in ("127.0.0.1", "::1", "localhost", "node-3.cluster.local", "10.0.0.7"):
        assert host_problem(ok) is None, ok
    for bad in ("not a host!", "", "-lead.example", "a..b", "300.1.1.1", "x" * 64):
        assert host_problem(bad) is not None, bad


# ------------------------------------------------------------------- Triton's interpreter


def test_interpreter_problem_names_the_fix():
    selected, unselected = parse_kernels("all"), parse_kernels("none")
    off = {"TRITON_INTERPRET": "0"}
    assert interpreter_problem(unselected, gpu=False, engine_in_process=True, environ=off) is None
    msg = interpreter_problem(selected, gpu=False, engine_in_process=False, environ=off)
    assert "TRITON_INTERPRET='0'" in msg and "export TRITON_INTERPRET=1 before starting vLLM" in msg
    assert interpreter_problem(selected, gpu=True, engine_in_process=True, environ={}) is None


# Triton imported first (as `import vllm` does), then the entry point, in a fresh process without
# TRITON_INTERPRET: refused with an in-process engine, accepted in the API-server process of a
# multiprocess engine (its engine process inherits TRITON_INTERPRET=1 from register()).
_FRESH = textwrap.dedent(
    """
    import os, triton
    from fuselane import plugin
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        plugin.register()
        print("IN-PROCESS registered")
    except plugin.FuselaneConfigError as e:
        print("IN-PROCESS refused:", e)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    plugin.register()
    print("MULTIPROCESS registered", os.environ.get("TRITON_INTERPRET"))
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the kernels compiled")
def test_in_process_engine_without_interpreter_is_refused_at_register():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    env.update(FUSELANE_KERNELS="all", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    refused = next(ln for ln in lines if ln.startswith("IN-PROCESS"))
    assert refused.startswith("IN-PROCESS refused: FUSELANE_KERNELS='all'"), refused
    assert "Triton was imported in this process before the plugin" in refused
    assert "export TRITON_INTERPRET=1 before starting vLLM" in refused
    assert "MULTIPROCESS registered 1" in lines
