"""Fixtures for tests/bench; the shared helpers live in bench_harness.py."""

from bench_harness import *  # noqa: F403
