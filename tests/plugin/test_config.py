"""FUSELANE_KERNELS parsing (plugin/config.py): no vLLM needed."""

from __future__ import annotations

import pytest

from fuselane.plugin.config import (
    ENV_VAR,
    FuselaneConfigError,
    kernels_from_env,
    parse_kernels,
)


@pytest.mark.parametrize(
    ("value", "families", "explicit"),
    [
        (None, set(), False),
        ("", set(), False),
        (" , ", set(), False),
        ("none", set(), True),
        ("all", {"attention", "kv_cache", "sampling"}, True),
        ("ALL", {"attention", "kv_cache", "sampling"}, True),
        ("attention", {"attention"}, True),
        (" kv_cache , attention ", {"attention", "kv_cache"}, True),
        ("sampling,sampling", {"sampling"}, True),
    ],
)
def test_valid_values(value, families, explicit):
    sel = parse_kernels(value)
    assert sel.families == frozenset(families)
    assert sel.explicit is explicit


@pytest.mark.parametrize("bad", ["attn", "all,none", "attention,bogus", "none,kv_cache", "1"])
def test_invalid_values_name_the_valid_ones(bad):
    with pytest.raises(FuselaneConfigError) as exc:
        parse_kernels(bad)
    msg = str(exc.value)
    assert msg.startswith(f"{ENV_VAR}={bad!r}")
    assert "valid values: attention, kv_cache, sampling, all, none" in msg


def test_error_is_a_value_error():
    assert issubclass(FuselaneConfigError, ValueError)


@pytest.mark.parametrize(
    ("value", "writes_kv"),
    [
        (None, True),
        ("all", True),
        ("attention,kv_cache", True),
        ("attention", False),
        ("none", False),
    ],
)
def test_backend_kv_write_rule(value, writes_kv):
    # The backend keeps vLLM's KV write only when the operator set the variable without kv_cache.
    assert parse_kernels(value).backend_writes_kv_cache is writes_kv


def test_describe_is_canonical():
    assert parse_kernels("sampling,attention").describe() == "attention, sampling"
    assert parse_kernels("none").describe() == "none"


def test_reads_the_given_environment():
    assert kernels_from_env({ENV_VAR: "kv_cache"}).families == {"kv_cache"}
    assert kernels_from_env({}).families == frozenset()
