"""`python -m fuselane.benchmarks.vllm_backend_tests`: see runner.py."""

from .runner import main

raise SystemExit(main())
