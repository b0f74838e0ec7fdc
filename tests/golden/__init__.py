"""Golden outputs of the tiny model on vLLM's CPU engine (docs/golden.md)."""
