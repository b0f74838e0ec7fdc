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
