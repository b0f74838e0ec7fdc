"""Shared set-up of the plugin tests: the tiny model and the engine runs (session fixtures:
each engine starts once per session, also when tests/golden, which imports these fixtures,
runs in the same session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuselane.serving.tiny_model import build_tiny_model

from .engines import once, run_engine


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return once(
        tmp_path_factory,
        "tiny_model",
        lambda: build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"),
    )


@pytest.fixture(scope="session")
def engine_out(tmp_path_factory) -> Path:
    return once(tmp_path_factory, "engine_out", lambda: tmp_path_factory.mktemp("engines"))


# Both runs' greedy pass is the golden one (`--golden`: PROMPTS and two more, 32 tokens each),
# which tests/golden compares with its committed file: the golden check adds no engine start.
@pytest.fixture(scope="session")
def stock_run(tmp_path_factory, tiny_model, engine_out) -> tuple[dict, str]:
    """vLLM's own kernels (FUSELANE_KERNELS unset)."""
    return once(
        tmp_path_factory,
        "stock_run",
        lambda: run_engine(tiny_model, engine_out, "stock", None, "--golden"),
    )


@pytest.fixture(scope="session")
def fuselane_run(tmp_path_factory, tiny_model, engine_out) -> tuple[dict, str]:
    """FUSELANE_KERNELS=all, no CLI flag."""
    return once(
        tmp_path_factory,
        "fuselane_run",
        lambda: run_engine(tiny_model, engine_out, "fuselane", "all", "--golden"),
    )
