"""FUSELANE_HOPPER_KERNELS=0: the operator's switch that keeps the Hopper (sm_90) kernels out of
a process so that fuselane's Triton attention kernels run every batch; parsed strictly, applied
by the plugin at start-up, undone by unregister(), checked in a canary arm's environment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fuselane.plugin.config import FuselaneConfigError, parse_hopper_kernels
from fuselane.serving.canary.config import CanaryConfigError, parse_config


@pytest.mark.parametrize("value,want", [(None, True), ("", True), ("1", True), ("0", False)])
def test_values(value, want):
    assert parse_hopper_kernels(value) is want


@pytest.mark.parametrize("value", ["off", "false", "no", "2", "0,1"])
def test_bad_values_are_refused_with_the_variable_named(value):
    with pytest.raises(FuselaneConfigError, match=f"FUSELANE_HOPPER_KERNELS={value!r}.*0.*1"):
        parse_hopper_kernels(value)


def _register(value: str | None) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(
        """
        import os
        os.environ["FUSELANE_KERNELS"] = "attention,kv_cache"
        from fuselane import plugin
        plugin.register()
        from fuselane.kernels import attention
        print("OFF:", attention.hopper_kernels_off())
        plugin.unregister()
        print("AFTER:", attention.hopper_kernels_off())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "FUSELANE_HOPPER_KERNELS"}
    if value is not None:
        env["FUSELANE_HOPPER_KERNELS"] = value
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip


def test_register_switches_the_hopper_kernels_off_and_unregister_back():
    done = _register("0")
    assert done.returncode == 0, done.stderr[-2000:]
    off, after = done.stdout.strip().splitlines()[-2:]
    assert off == "OFF: FUSELANE_HOPPER_KERNELS=0"
    # Back to what this Triton and machine allow on their own (None where Gluon's Hopper names
    # exist; the missing name's reason otherwise), never the switch's reason.
    assert after.startswith("AFTER:") and "FUSELANE_HOPPER_KERNELS" not in after


def test_a_bad_value_stops_the_start():
    done = _register("off")
    assert done.returncode != 0
    assert "FUSELANE_HOPPER_KERNELS='off'" in done.stderr


def test_a_canary_arm_with_a_bad_value_is_refused(tmp_path):
    model = {"id": "tiny", "source": str(tmp_path)}
    ok = {"model": model, "arms": {"custom": {"env": {"FUSELANE_HOPPER_KERNELS": "0"}}}}
    assert parse_config(ok).arm_env("custom")["FUSELANE_HOPPER_KERNELS"] == "0"
    bad = {"model": model, "arms": {"custom": {"env": {"FUSELANE_HOPPER_KERNELS": "off"}}}}
    with pytest.raises(CanaryConfigError, match="FUSELANE_HOPPER_KERNELS='off'"):
        parse_config(bad)
