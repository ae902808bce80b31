"""Fixtures for the pipeline tests; the fakes themselves are in series_fakes.py."""

from pathlib import Path

import pytest
from series_fakes import Project, message, new_project, series_from_commits


@pytest.fixture
def project(tmp_path: Path) -> Project:
    return new_project(tmp_path)


@pytest.fixture(scope="session")
def three_patches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Made once: tests only read the bytes and write them into their own roots."""
    return series_from_commits(
        tmp_path_factory.mktemp("three"),
        [
            ("environ", message("environ: raise ENV_25")),
            ("scheduler", message("scheduler: raise SCHED_25", status="forwarded #123")),
            ("server", message("server: raise SERVER_25", status="not-needed")),
        ],
    )
