"""vLLM's own attention-backend tests, run with fuselane's backend added to vLLM's backends.

`python -m fuselane.benchmarks.vllm_backend_tests --vllm-tests DIR --out FILE.json`; see
`runner.py` for the steps and docs/notes/vllm-backend-tests.md for how to run it and read it.
"""
