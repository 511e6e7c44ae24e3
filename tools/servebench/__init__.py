"""Pieces of the serving benchmark (tools/bench_serving.py): request sets and their
warm-up twins (`requests`), one engine switched between prefill methods and measured
alone or under Poisson load (`harness`), the two-engine-process sharing experiment
(`sharing`, whose worker is `python -m tools.servebench.worker`), and the summary
statistics and table (`report`)."""
