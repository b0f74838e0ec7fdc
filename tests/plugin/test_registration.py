"""The entry point: registration in a fresh process, CUSTOM, laziness, idempotence, bad values."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from .engines import engine_env

BACKEND_PATH = "fuselane.plugin.backend.FuselaneAttentionBackend"

# Loads vLLM's general plugins the way every vLLM process does, then reports what it sees.
FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys
    from importlib.metadata import entry_points
    from vllm.plugins import load_general_plugins
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    eps = [ep.value for ep in entry_points(group="vllm.general_plugins") if ep.name == "fuselane"]
    load_general_plugins()
    lazy = "fuselane.kernels.attention" not in sys.modules
    custom = AttentionBackendEnum.CUSTOM
    cls = custom.get_class()
    print(json.dumps({
        "entry_points": eps,
        "custom_path": custom.get_path(),
        "custom_class": f"{cls.__module__}.{cls.__qualname__}",
        "custom_name": cls.get_name(),
        "kernels_lazy": lazy,
        "chooser": getattr(current_platform.__dict__.get("get_attn_backend_cls"),
                           "__fuselane__", False),
    }))
    """
)


def _fresh(code: str, kernels: str | None, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env=engine_env(kernels),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_entry_point_registers_custom_in_a_fresh_process():
    proc = _fresh(FRESH_PROCESS, "all")
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["entry_points"] == ["fuselane.plugin:register"]
    assert seen["custom_path"] == BACKEND_PATH
    assert seen["custom_class"] == BACKEND_PATH  # CUSTOM resolves to fuselane's class
    assert seen["custom_name"] == "CUSTOM"  # vLLM maps a layer's backend back to its enum name
    assert seen["kernels_lazy"], "register() imported the kernels before vLLM asked for them"
    assert seen["chooser"], "the backend chooser is not installed on the platform"


def test_invalid_fuselane_kernels_stops_server_start_up():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "/nonexistent-model-never-read",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=engine_env("attention,flash"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "FUSELANE_KERNELS='attention,flash': unknown value(s) ['flash']" in out, out[-4000:]
    assert "valid values: attention, kv_cache, sampling, all, none" in out


@pytest.fixture
def registered(monkeypatch):
    """fuselane registered here with FUSELANE_KERNELS=attention,kv_cache; undone after."""
    import fuselane.plugin as plugin

    plugin.unregister()
    monkeypatch.setenv("FUSELANE_KERNELS", "attention,kv_cache")
    plugin.register()
    yield plugin
    plugin.unregister()


def test_register_is_idempotent_and_undoable(registered):
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    chooser = current_platform.__dict__["get_attn_backend_cls"]
    registered.register()  # a second call changes nothing
    assert current_platform.__dict__["get_attn_backend_cls"] is chooser
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH
    assert registered.active_selection().describe() == "attention, kv_cache"
    registered.unregister()
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
    assert "get_attn_backend_cls" not in current_platform.__dict__


def test_register_raises_on_invalid_value(monkeypatch):
    import fuselane.plugin as plugin

    plugin.unregister()
    monkeypatch.setenv("FUSELANE_KERNELS", "kv-cache")
    with pytest.raises(plugin.FuselaneConfigError, match="valid values"):
        plugin.register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert not AttentionBackendEnum.CUSTOM.is_overridden()
