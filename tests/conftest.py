"""Test-wide set-up: kernels run under the Triton interpreter when no GPU is present, and every
kernel call checks its device-side indices (FUSELANE_CHECK_INDICES, here and in the engines the
tests start)."""

import os

from fuselane.kernels import index_checks, use_interpreter_without_gpu

# Must happen before any module defines a @triton.jit function.
use_interpreter_without_gpu()
os.environ.setdefault("FUSELANE_CHECK_INDICES", "1")
index_checks.enable(os.environ["FUSELANE_CHECK_INDICES"] == "1")

# Whole runs of the product (a demo with its own Ray cluster, a two-node cluster): minutes
# each on two cores, so they run with `python -m pytest -m extended`, outside CI's 20 minutes.
EXTENDED_MODULES = ("test_demo.py", "test_canary_two_node.py")


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.path.name in EXTENDED_MODULES:
            item.add_marker(pytest.mark.extended)
