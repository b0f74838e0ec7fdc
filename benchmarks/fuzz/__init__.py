"""Kernel fuzzer: random configurations of each kernel family against its torch reference.

- `kernel_fuzz.py`: the command line (`python -m fuselane.benchmarks.fuzz.kernel_fuzz`) and the
  results JSON;
- `core.py`: the case loop and its bookkeeping (passed, refused, mismatched, errors, compiled
  variants), outcome types, comparison helpers;
- `attention.py`, `kv_cache.py`, `sampling.py` (with `sampling_checks.py`): each family's
  profiles (what the kernels compile for), draws, inputs and comparison.

How to run it and reproduce a failure: docs/notes/fuzz.md.
"""
