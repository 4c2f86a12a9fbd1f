"""Benchmarks that measure each optimization against a baseline in the same run."""
