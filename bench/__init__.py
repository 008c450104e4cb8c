"""Benchmarks of oomguard (scripts/bench, `python -m bench`): measured against same-run baselines."""
