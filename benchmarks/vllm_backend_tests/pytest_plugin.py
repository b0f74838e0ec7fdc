"""pytest plugin that puts fuselane's backend into vLLM's attention-backend tests.

Loaded with `-p fuselane.benchmarks.vllm_backend_tests.pytest_plugin` into a pytest run of a
copy of vLLM's `tests/v1/attention/test_attention_backends.py` (the runner builds the copy).
vLLM's test file is not edited; the plugin works through names the module defines:

- `pytest_configure` registers fuselane the way vLLM's plugin loader does
  (`fuselane.plugin.register()`: `AttentionBackendEnum.CUSTOM` -> fuselane's backend).
- Every module-level list whose name ends in `BACKENDS_TO_TEST` (0.26: `BACKENDS_TO_TEST`,
  `SLIDING_WINDOW_BACKENDS_TO_TEST`, `NON_CAUSAL_BACKENDS_TO_TEST`) gets
  `AttentionBackendEnum.CUSTOM` appended, as a backend added to vLLM's source would be.
- vLLM's tests loop over a list of backends inside one test, and the first failure ends the
  loop. So every test that calls `_test_backend_correctness` is parametrized once per backend
  (`--fl-backends`), and a wrapper of `_test_backend_correctness` runs only that backend. A
  backend in none of the lists the test function reads is skipped with that reason.
- A wrapper of `run_attention_backend` asks fuselane's backend, before it runs, what vLLM's
  selector would ask it: `validate_configuration` with the layer's head size, dtype, KV-cache
  dtype, block size, attention type, sliding window and causality. A configuration it refuses
  is skipped with `REFUSED` and the reasons: vLLM would never give fuselane that layer.
  Stock backends run exactly as vLLM's test runs them; their answer to the same question is
  recorded too (`validation` property), for comparison.

Tests run backend after backend, in `--fl-backends` order (`--fl-deadline`: none starts
after it). What ran is written into each test's junit properties (`backend`, `params`, `ran`,
`validation`), which `results.py` reads.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Callable
from typing import Any

import pytest

CUSTOM = "CUSTOM"
# The skip message of a configuration fuselane refuses; results.py classifies by it.
REFUSED = "fuselane refuses this configuration (validate_configuration): "
NOT_LISTED = "not in this test's backend lists: "
OUT_OF_TIME = "not started: the run's time budget is spent"
LIST_SUFFIX = "BACKENDS_TO_TEST"
# The functions of vLLM's test module the plugin wraps (0.26 names; see the module docstring).
CORRECTNESS_FN = "_test_backend_correctness"
RUN_FN = "run_attention_backend"
FIXTURE = "vllm_backend"

# This process's state: the backend the running test is for, the test's node (where the
# wrappers record), and the backend lists as patched (for the environment file).
_current: dict[str, Any] = {"backend": None, "node": None, "lists": {}}


def backend_name(backend: Any) -> str:
    """`"TRITON_ATTN"` for `AttentionBackendEnum.TRITON_ATTN`; strings (vLLM's test uses
    "FLEX_ATTENTION_SLOW") stay as they are."""
    return backend if isinstance(backend, str) else backend.name


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fuselane", "fuselane in vLLM's attention-backend tests")
    group.addoption("--fl-backends", default=CUSTOM, help="comma list of backends to run")
    group.addoption("--fl-specs", default="", help="comma list of batch specs (default: all)")
    group.addoption("--fl-tp", default="", help="comma list of tensor_parallel_size values")
    group.addoption(
        "--fl-deadline", type=float, default=0.0, help="time.time() after which no test starts"
    )
    group.addoption("--fl-env-out", default="", help="write the run's environment (JSON) here")


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def pytest_configure(config: pytest.Config) -> None:
    # The whole fuselane backend (its attention and its KV write), as with
    # `--attention-backend CUSTOM`; the sampler is not part of these tests.
    os.environ.setdefault("FUSELANE_KERNELS", "attention,kv_cache")
    import fuselane.plugin as plugin

    plugin.register()


def _patch_module(module: Any) -> None:
    """Append CUSTOM to the module's backend lists and wrap its two functions (once)."""
    if getattr(module, "__fuselane_patched__", False):
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for name in (CORRECTNESS_FN, RUN_FN):
        if not callable(getattr(module, name, None)):
            raise RuntimeError(
                f"{module.__name__} defines no {name}(): this vLLM's test is shaped differently "
                "from the one fuselane.benchmarks.vllm_backend_tests.pytest_plugin adapts"
            )
    custom = AttentionBackendEnum.CUSTOM
    for name, value in vars(module).items():
        if name.endswith(LIST_SUFFIX) and isinstance(value, list):
            if custom not in value:
                value.append(custom)
            _current["lists"][name] = [backend_name(b) for b in value]
    setattr(module, CORRECTNESS_FN, _only_current_backend(getattr(module, CORRECTNESS_FN)))
    setattr(module, RUN_FN, _validated(getattr(module, RUN_FN)))
    module.__fuselane_patched__ = True


def _record(name: str, value: Any) -> None:
    node = _current["node"]
    if node is not None:
        node.user_properties.append((name, value if isinstance(value, str) else json.dumps(value)))


def _only_current_backend(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def correctness(*args: Any, **kwargs: Any) -> Any:
        current = _current["backend"]
        if current is None:  # not a parametrized test
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        listed = bound.arguments["backend_to_test"]
        chosen = [b for b in listed if backend_name(b) == current]
        if not chosen:
            return None
        bound.arguments["backend_to_test"] = chosen
        _record("ran", {"block_size": bound.arguments.get("block_size")})
        return original(*bound.args, **bound.kwargs)

    correctness.__wrapped__ = original  # type: ignore[attr-defined]
    return correctness


def selector_reasons(backend_cls: type, arguments: dict[str, Any]) -> list[str]:
    """`backend_cls.validate_configuration` for the layer `run_attention_backend` is about to
    run, with the fields vLLM's selector fills (`AttentionSelectorConfig`, as this vLLM
    defines it)."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from fuselane.plugin import vllm_compat as vc

    vllm_config = arguments["vllm_config"]
    spec = arguments["kv_cache_spec"]
    metadata = arguments["common_attn_metadata"]
    fields = {
        "head_size": vllm_config.model_config.get_head_size(),
        "dtype": spec.dtype,
        "kv_cache_dtype": vllm_config.cache_config.cache_dtype,
        # The cache's block size, as the kernels will read it (vLLM's selector passes it when
        # the user set one).
        "block_size": spec.block_size,
        "attn_type": arguments["attn_type"],
        "has_sliding_window": arguments.get("sliding_window") is not None,
        "use_non_causal": not getattr(metadata, "causal", True),
    }
    config = AttentionSelectorConfig(
        **{k: v for k, v in fields.items() if k in AttentionSelectorConfig._fields}
    )
    return vc.validate_backend(backend_cls, config)


def _validated(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def run(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        backend = bound.arguments["backend"]
        name = backend_name(backend)
        cls = backend.get_class() if hasattr(backend, "get_class") else None
        if cls is not None:
            try:
                reasons = selector_reasons(cls, bound.arguments)
            except Exception as e:  # a stock backend's answer is only recorded
                reasons = [f"validation could not be asked: {type(e).__name__}: {e}"]
                if name == CUSTOM:
                    raise
            _record("validation", {name: reasons})
            if name == CUSTOM and reasons:
                pytest.skip(REFUSED + "; ".join(reasons))
        return original(*args, **kwargs)

    run.__wrapped__ = original  # type: ignore[attr-defined]
    return run


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if FIXTURE not in metafunc.fixturenames:
        return
    if CORRECTNESS_FN not in metafunc.function.__code__.co_names:
        return  # a unit test of one backend's internals: runs once, as vLLM wrote it
    backends = _csv(metafunc.config.getoption("--fl-backends"))
    metafunc.parametrize(FIXTURE, backends, ids=backends, indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    specs = _csv(config.getoption("--fl-specs"))
    tps = _csv(config.getoption("--fl-tp"))
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        spec = params.get("batch_spec_name")
        tp = params.get("tensor_parallel_size")
        if (specs and spec is not None and spec not in specs) or (
            tps and tp is not None and str(tp) not in tps
        ):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    # One backend after another, in --fl-backends order (fuselane first by default): under a
    # time budget the first backend's tests are the ones sure to run. The sort is stable, so
    # vLLM's order holds within a backend.
    order = _csv(config.getoption("--fl-backends"))

    def rank(item: pytest.Item) -> int:
        backend = getattr(getattr(item, "callspec", None), "params", {}).get(FIXTURE)
        return order.index(backend) if backend in order else len(order)

    items[:] = sorted(keep, key=rank)


@pytest.fixture(autouse=True)
def vllm_backend(request: pytest.FixtureRequest) -> Any:
    """The backend this instance of a test runs (None: a test that is not parametrized)."""
    backend = getattr(request, "param", None)
    node = request.node
    params = {
        k: (v if isinstance(v, int | float | str | bool) else repr(v))
        for k, v in getattr(getattr(node, "callspec", None), "params", {}).items()
        if k != FIXTURE
    }
    node.user_properties.append(("backend", backend or "n/a"))
    node.user_properties.append(("params", json.dumps(params, sort_keys=True)))
    deadline = request.config.getoption("--fl-deadline")
    if deadline and time.time() > deadline:
        pytest.skip(OUT_OF_TIME)
    if backend is None:
        yield None
        return
    module = request.module
    _patch_module(module)
    read = [n for n in request.function.__code__.co_names if n.endswith(LIST_SUFFIX)]
    listed = {backend_name(b) for n in read for b in getattr(module, n)}
    if backend not in listed:
        pytest.skip(NOT_LISTED + f"{backend} is in none of {', '.join(read) or 'no list'}")
    _current.update(backend=backend, node=node)
    try:
        yield backend
    finally:
        _current.update(backend=None, node=None)


def environment() -> dict[str, Any]:
    """What the run ran on: versions, the GPU, fuselane's registration, the patched lists."""
    import torch
    import triton
    import vllm

    from fuselane.plugin import vllm_compat as vc

    env: dict[str, Any] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "custom_backend": vc.backend_class_for_name(CUSTOM).__module__
        + "."
        + vc.backend_class_for_name(CUSTOM).__qualname__,
        "fuselane_kernels": os.environ.get("FUSELANE_KERNELS"),
        "backend_lists": dict(_current["lists"]),
    }
    # Set when a Hopper kernel failed to compile or launch and the Triton kernels took over
    # (the tests then checked those): a fuselane failure of its own, to report.
    from fuselane.kernels import attention as attn_kernels

    env["hopper_kernels_off"] = attn_kernels.hopper_kernels_off()
    capability = vc.device_capability()
    if capability is not None:
        env["capability"] = f"{capability.major}.{capability.minor}"
    return env


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = session.config.getoption("--fl-env-out")
    if out:
        with open(out, "w") as f:
            json.dump(environment(), f, indent=2)
