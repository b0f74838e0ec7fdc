"""Kernel benchmarks: one GPU script per kernel family, and `fuselane bench kernels`.

- `bench_<family>.py` (attention, kv_cache, sampling): a family's script, timing fuselane and
  its peers in one process; its parts are `<family>_workload.py` (cases, inputs, the reference
  check), `kv_cache_checks.py` / `sampling_checks.py` (broad GPU checks; attention's are in its
  workload module), `attention_timing.py` (attention's peers and runner), `<family>_sections.py`
  (the goal cases) and `<family>_sweep.py` (launch-configuration sweeps); `family_script.py`
  holds what the scripts share, `from_checkout.py` lets them run by path from a checkout.
- `bench_host_overhead.py`, `bench_startup.py`, `bench_telemetry_overhead.py`: host time per
  call, start-up compiles, telemetry overhead.
- `fuselane bench kernels`: `cli.py` (arguments), `suite.py` (the run), `grid.py` (model
  shapes, cases), `<family>_cases.py` (each family's implementations of a case), `impls.py`,
  `peers.py` (optional peers, FlashInfer's builds), `outputs.py` (JSON, markdown, plots),
  `gate.py` (a run against a committed baseline).
"""
