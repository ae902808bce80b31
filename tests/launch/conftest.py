"""Fixtures for tests/launch; the shared helpers live in launch_harness.py."""

from launch_harness import *  # noqa: F403
