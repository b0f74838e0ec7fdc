"""Shared set-up of the plugin tests: the tiny model and the engine runs (session fixtures:
each engine starts once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuselane.serving.tiny_model import build_tiny_model

from .engines import run_engine


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def engine_out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def stock_run(tiny_model, engine_out) -> tuple[dict, str]:
    """vLLM's own kernels (FUSELANE_KERNELS unset)."""
    return run_engine(tiny_model, engine_out, "stock", None)


@pytest.fixture(scope="session")
def fuselane_run(tiny_model, engine_out) -> tuple[dict, str]:
    """FUSELANE_KERNELS=all, no CLI flag."""
    return run_engine(tiny_model, engine_out, "fuselane", "all")
