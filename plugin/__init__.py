"""Everything that runs inside a vLLM process: the entry point, backend, sampler hook, telemetry."""
