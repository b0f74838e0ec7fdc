"""Kernel benchmarks against peers (GPU) and end-to-end serving benchmarks."""
