"""The golden tests use the plugin tests' tiny model and engine runs: the same fixtures, and,
in one session, the same runs (tests/plugin/engines.once)."""

from tests.plugin.conftest import engine_out, fuselane_run, stock_run, tiny_model

__all__ = ["engine_out", "fuselane_run", "stock_run", "tiny_model"]
