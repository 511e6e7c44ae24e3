"""Baselines of tools/bench_store.py."""
