"""Fake upstream wheels and throwaway repo roots for testing tools/series.py end to end.

Every test gets its own root (patches/, overlay/, tests/) and wheel cache under tmp_path and
runs the real pipeline as a subprocess, so nothing touches the network or this repository.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "tools" / "series.py"
NAME = "sglang"
VERSION = "0.5.23"
TAG = f"cp311-cp311-manylinux_2_34_{os.uname().machine}"
TEST_FILE = "tests/fake/test_hook.py"
IDENTITY = {
    "GIT_AUTHOR_NAME": "Patch Author",
    "GIT_AUTHOR_EMAIL": "author@example.invalid",
    "GIT_COMMITTER_NAME": "Patch Author",
    "GIT_COMMITTER_EMAIL": "author@example.invalid",
}


def numbered(prefix: str, count: int) -> str:
    return "".join(f"{prefix}_{i} = {i}\n" for i in range(1, count + 1))


# The upstream tree of the fake release. Each module is long enough that a patch near its end
# keeps its context when lines are inserted above it (an offset), and distinct enough that a
# changed context line is a conflict.
UPSTREAM = {
    "sglang/__init__.py": '__version__ = "0.5.23"\n',
    "sglang/srt/environ.py": numbered("ENV", 30),
    "sglang/srt/scheduler.py": numbered("SCHED", 30),
    "sglang/srt/server.py": numbered("SERVER", 30),
}
METADATA = (
    "Metadata-Version: 2.4\n"
    "Name: sglang\n"
    "Version: {version}\n"
    "Summary: Fake upstream for pipeline tests\n"
    "Requires-Python: >=3.10\n"
    "Requires-Dist: numpy\n"
    "Requires-Dist: torch==2.9.1; extra == 'srt'\n"
    "Provides-Extra: srt\n"
    "\n"
    "Long description kept byte for byte.\n"
)
WHEEL = "Wheel-Version: 1.0\nGenerator: fake-builder 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n"


def tool_python() -> str:
    """The test interpreter, which must have pypa wheel (tests/requirements.txt pins it)."""
    import wheel  # noqa: F401  (an ImportError here is a broken test environment, not a skip)

    return sys.executable


def make_wheel(cache: Path, files: dict[str, str], version: str = VERSION, tag: str = TAG) -> Path:
    """A wheel named like upstream's, with a valid dist-info, packed by pypa wheel."""
    stage = cache.parent / f"stage-{version}-{tag}"
    info = stage / f"{NAME}-{version}.dist-info"
    for rel, text in files.items():
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_text(text)
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(METADATA.format(version=version))
    (info / "WHEEL").write_text(WHEEL.format(tag=tag))
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [tool_python(), "-m", "wheel", "pack", "--dest-dir", str(cache), str(stage)],
        check=True,
        capture_output=True,
        env={**os.environ, "SOURCE_DATE_EPOCH": "946684800"},
    )
    wheel = cache / f"{NAME}-{version}-{tag}.whl"
    assert wheel.is_file()
    return wheel


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Project:
    """A repo root laid out like ours, with its own wheel cache."""

    root: Path
    cache: Path

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def src(self) -> Path:
        return self.root / "build" / "src"

    @property
    def dist(self) -> Path:
        return self.root / "dist"

    def pin(self, wheels: dict[str, Path], version: str = VERSION) -> None:
        lines = [f'[upstream]\nname = "{NAME}"\nversion = "{version}"\n\n[wheels]\n']
        lines += [f'"{tag}" = "{sha256(wheel)}"\n' for tag, wheel in sorted(wheels.items())]
        self.patches.mkdir(parents=True, exist_ok=True)
        (self.patches / "upstream.toml").write_text("".join(lines))

    def series(self, patches: dict[str, bytes]) -> None:
        """Replace the series with these patches, in this order."""
        for old in self.patches.glob("*.patch"):
            old.unlink()
        for name, data in patches.items():
            (self.patches / name).write_bytes(data)
        (self.patches / "series").write_text("".join(f"{n}\n" for n in patches))

    def overlay(self, rel: str, text: str) -> None:
        path = self.root / "overlay" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def run(self, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "SM120PD_CACHE": str(self.cache)}
        return subprocess.run(
            [tool_python(), str(SERIES), "--root", str(self.root), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    def ok(self, *args: str) -> subprocess.CompletedProcess:
        result = self.run(*args)
        assert result.returncode == 0, result.stdout + result.stderr
        return result

    def errors(self, result: subprocess.CompletedProcess) -> list[str]:
        return [line for line in result.stderr.splitlines() if line.startswith("error: ")]

    def commit(self, edits: dict[str, str], message: str) -> None:
        """Commit edits to the built tree, as a developer editing a patch would."""
        for rel, text in edits.items():
            (self.src / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.src / rel).write_text(text)
        env = {**os.environ, **IDENTITY}
        subprocess.run(["git", "add", "--all"], cwd=self.src, check=True, env=env)
        subprocess.run(
            ["git", "commit", "--quiet", "--no-verify", "-m", message],
            cwd=self.src,
            check=True,
            env=env,
        )

    def patch_bytes(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.patches.glob("*.patch"))}


def message(subject: str, status: str = "upstreamable", tests: str = TEST_FILE) -> str:
    return (
        f"{subject}\n\nWhy-Patch: the change edits an upstream module in place.\n"
        f"Upstream-Status: {status}\nTests: {tests}\n"
    )


def edit_line(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


# Three independent patches, one per module, each changing a line near the end of its module.
EDITS = {
    "environ": ("sglang/srt/environ.py", "ENV_25 = 25\n", "ENV_25 = 2500\n"),
    "scheduler": ("sglang/srt/scheduler.py", "SCHED_25 = 25\n", "SCHED_25 = 2500\n"),
    "server": ("sglang/srt/server.py", "SERVER_25 = 25\n", "SERVER_25 = 2500\n"),
}


def new_project(tmp_path: Path, name: str = "root") -> Project:
    project = Project(tmp_path / name, tmp_path / f"{name}-cache")
    (project.root / TEST_FILE).parent.mkdir(parents=True)
    (project.root / TEST_FILE).write_text("def test_hook():\n    pass\n")
    project.pin({TAG: make_wheel(project.cache, UPSTREAM)})
    project.series({})
    return project


def series_from_commits(tmp_path: Path, commits: list[tuple[str, str]]) -> dict[str, bytes]:
    """Patches made the supported way: build, commit in build/src, refresh.

    commits: (key of EDITS, commit message) in order. Made in a scratch root so the caller can
    lay the result over any upstream.
    """
    scratch = new_project(tmp_path, "scratch")
    scratch.ok("build")
    for key, text in commits:
        rel, old, new = EDITS[key]
        scratch.commit({rel: edit_line((scratch.src / rel).read_text(), old, new)}, text)
    scratch.ok("refresh")
    return scratch.patch_bytes()
