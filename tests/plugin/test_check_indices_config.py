"""FUSELANE_CHECK_INDICES: parsed strictly, turned on by the plugin, and settable per canary
arm (`arms.custom.check_indices`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fuselane.plugin.config import FuselaneConfigError, parse_check_indices
from fuselane.serving.canary.config import parse_config


@pytest.mark.parametrize("value,want", [(None, False), ("", False), ("0", False), ("1", True)])
def test_values(value, want):
    assert parse_check_indices(value) is want


@pytest.mark.parametrize("value", ["yes", "true", "2", "1,0"])
def test_bad_values_are_refused_with_the_variable_named(value):
    with pytest.raises(FuselaneConfigError, match=f"FUSELANE_CHECK_INDICES={value!r}.*1.*0"):
        parse_check_indices(value)


def test_register_turns_the_checks_on_in_a_fresh_process():
    code = textwrap.dedent(
        """
        import os
        os.environ["FUSELANE_KERNELS"] = "none"
        os.environ["FUSELANE_CHECK_INDICES"] = "1"
        from fuselane.kernels import index_checks
        assert not index_checks.enabled()
        from fuselane import plugin
        plugin.register()
        print("ON" if index_checks.enabled() else "OFF")
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "FUSELANE_CHECK_INDICES"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ON")


def test_the_canary_custom_arm_field_sets_the_variable(tmp_path):
    model = {"id": "tiny", "source": str(tmp_path)}
    config = parse_config({"model": model, "arms": {"custom": {"check_indices": True}}})
    assert config.arm_env("custom")["FUSELANE_CHECK_INDICES"] == "1"
    assert "FUSELANE_CHECK_INDICES" not in config.arm_env("stock")
