"""Fixtures for tests/pd; the shared helpers live in pd_harness.py."""

from pd_harness import *  # noqa: F403
