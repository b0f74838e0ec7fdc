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


# CI runs the tests outside tests/kernels on two workers: `pytest -n 2 --dist loadfile`, with
# the scheduler below. Each module runs whole on one worker (its module set-up once), except
# that some modules run together, in file order, as one unit:
# - the modules whose tests bring up a Ray cluster with a canary on this machine: never two
#   clusters at once (Ray's ports and agents, two engines each on two cores);
RAY_MODULES = ("test_canary.py", "test_canary_fault.py", "test_canary_runtime.py")
# - the modules that use the session's engine runs (tests/plugin/conftest.py `stock_run`,
#   `fuselane_run`: minutes under the interpreter, kept per process), so that each runs once.
ENGINE_RUN_MODULES = (
    "tests/golden/test_golden.py",
    "tests/plugin/test_engine.py",
    "tests/plugin/test_sampler_hook.py",
    "tests/plugin/test_server.py",
)
ENGINE_RUNS = ("stock_run", "fuselane_run")
# Those two units go first, one to each worker; the other modules fill in around them.
FIRST_UNITS = ("ray-cluster", "engine-runs")


def unit_of(module: str) -> str:
    """The scheduling unit of a test module, by its path relative to the root."""
    if module.rsplit("/", 1)[-1] in (*RAY_MODULES, *EXTENDED_MODULES):
        return "ray-cluster"
    if module in ENGINE_RUN_MODULES:
        return "engine-runs"
    return module


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.path.name in EXTENDED_MODULES:
            item.add_marker(pytest.mark.extended)
        module = item.nodeid.split("::", 1)[0]
        if set(ENGINE_RUNS) & set(item.fixturenames) and module not in ENGINE_RUN_MODULES:
            raise pytest.UsageError(
                f"{module} uses {' or '.join(ENGINE_RUNS)}: add it to ENGINE_RUN_MODULES in "
                "tests/conftest.py (on two workers the runs would otherwise happen twice)"
            )
    if hasattr(config, "workerinput"):  # an xdist worker: the first units first, stable
        first = {unit: k for k, unit in enumerate(FIRST_UNITS)}
        items.sort(key=lambda i: first.get(unit_of(i.nodeid.split("::", 1)[0]), len(first)))


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` by `unit_of` instead of by file, in the workers' (sorted) order.

    (Not `--dist loadgroup` with xdist_group marks: xdist 3.8 appends the group to
    `item._nodeid`, which pytest 9's `Node.nodeid` no longer reads, so the marks group
    nothing.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByUnit(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid.split("::", 1)[0])

    config.option.loadscopereorder = False  # the order is the workers' collection order
    return ByUnit(config, log)
