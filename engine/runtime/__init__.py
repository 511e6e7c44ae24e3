"""Execution: per-request cache handles (sequence.py), the `ModelRunner` (runner.py) and
sampling / stop conditions (sampling.py). Kept import-free: engine.cache imports
engine.runtime.sequence."""
