"""fuselane's Grafana dashboards, defined as code with the Grafana Foundation SDK.

Two dashboards, generated as JSON into `grafana/dashboards/` (committed) by `fuselane
dashboards`; `fuselane dashboards --check` fails when the committed files are stale:

- `kernels.py`: per-kernel telemetry (latency quantiles, launches, numerical checks), from
  vLLM's `/metrics` (`fuselane_*`) or from Ray Serve replicas (`ray_fuselane_*`);
- `canary.py`: the Ray Serve canary (weight, traffic split, errors, failovers, the arms' vLLM
  latency, shadow agreement, rollbacks).

Nothing here imports the SDK at import time (`fuselane --help` works without it); it comes
with the `dashboards` extra, pinned to the Grafana version the JSON is written for.
"""

from __future__ import annotations

from typing import Any

# file name (under grafana/dashboards/) -> module with `build()`
DASHBOARDS = {
    "fuselane-kernels.json": "kernels",
    "fuselane-canary.json": "canary",
}


def build_all() -> dict[str, dict[str, Any]]:
    """Every dashboard as Grafana's JSON model, keyed by its file name."""
    from importlib import import_module

    return {
        name: import_module(f"{__name__}.{module}").build() for name, module in DASHBOARDS.items()
    }
