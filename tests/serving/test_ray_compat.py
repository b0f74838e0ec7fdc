"""Every private Ray name the canary uses resolves against the installed Ray
(serving/canary/ray_compat.py is the only module that imports them)."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("ray.serve.llm")


def test_every_private_name_resolves():
    from fuselane.serving.canary import ray_compat

    for name in ray_compat.__all__:
        assert getattr(ray_compat, name) is not None, name
    assert inspect.isclass(ray_compat.VLLMEngine) and inspect.isclass(ray_compat.CallbackBase)
    for model in ("ChatCompletionRequest", "CompletionRequest", "ErrorResponse", "ModelCard"):
        assert hasattr(getattr(ray_compat, model), "model_fields"), model  # pydantic models
    assert callable(ray_compat.router_request_timeout)
    assert {"models", "completions", "chat"} <= set(ray_compat.DEFAULT_ENDPOINTS)


def test_the_cluster_helpers_resolve():
    """The `ray._private` names that find this machine's clusters and keep a node on 127.0.0.1."""
    import os

    from ray._private import ray_constants

    from fuselane.serving.canary import ray_compat

    assert isinstance(ray_compat.find_gcs_addresses(), set)
    latest = ray_compat.latest_ray_start_address()
    assert latest is None or ":" in latest
    # Resolved, not called: it turns token authentication on for the rest of the process.
    from ray._private.authentication import authentication_token_setup as auth

    assert callable(auth.maybe_enable_token_auth_if_token_available)
    before, env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(ray_compat.SINGLE_MACHINE_ENV)
    with ray_compat.loopback_node():
        assert ray_constants.ENABLE_RAY_CLUSTER is False
        assert os.environ[ray_compat.SINGLE_MACHINE_ENV] == "0"
    assert ray_constants.ENABLE_RAY_CLUSTER is before
    assert os.environ.get(ray_compat.SINGLE_MACHINE_ENV) == env


def test_importing_it_imports_no_ray_serve_llm():
    """`fuselane canary` finds its cluster through this module before anything imports Ray Serve
    LLM and vLLM (seconds, and their log lines); every demo worker imports it as it starts."""
    import subprocess
    import sys

    code = (
        "import sys; import fuselane.serving.canary.cluster, "
        "fuselane.serving.canary.local_cluster; "
        "print(sorted(m for m in sys.modules if m.startswith(('vllm', 'ray.llm'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
