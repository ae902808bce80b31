"""A copy of env/ per test stack: free loopback ports, its own run dir, fast polling."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
PD = ROOT / "launch" / "pd"
SECRET = "sk-test-6f1d2c9a-never-print-me"
sys.path.insert(0, str(ROOT))

from launch.pdlib import envfiles, supervise  # noqa: E402
from launch.pdlib.stack import free_loopback_ports  # noqa: E402


def set_values(path: Path, **values: str) -> None:
    """Replace KEY=... lines in an env file (appending keys it does not have), verbatim."""
    envfiles.set_values(path, values)


def set_free_ports(env: Path, run_dir: Path, **more: str) -> None:
    """common.env of a copied env dir on free loopback ports, with its own run dir (and `more`)."""
    prefill, boot, decode, router, prom = free_loopback_ports(5)
    set_values(
        env / "common.env",
        PREFILL_PORT=str(prefill),
        PREFILL_BOOTSTRAP_PORT=str(boot),
        DECODE_PORT=str(decode),
        ROUTER_PORT=str(router),
        ROUTER_PROMETHEUS_PORT=str(prom),
        PD_RUN_DIR=str(run_dir),
        **more,
    )


def make_env_dir(tmp: Path, api_key: str = "") -> Path:
    env = tmp / "env"
    shutil.copytree(ROOT / "env", env, ignore=shutil.ignore_patterns("ab", "backups", "cpu*"))
    set_free_ports(env, tmp / "run", PD_POLL_INTERVAL_S="0.2", API_KEY=api_key)
    set_values(
        env / "router.env",
        ROUTER_ARGS='"--policy round_robin --health-check-interval-secs 1 '
        '--worker-startup-check-interval 1"',
    )
    # A knob value of decode's own, which the tests look for live in decode's process (the
    # shipped auto would not tell decode's environment from a default).
    set_values(env / "decode.env", SGLANG_SM120_MMA_TARGET_CTAS="512")
    return env


def fake_manifest_path(tmp: Path) -> Path:
    """A dist-info that makes importlib.metadata see our patched build (label of this checkout)."""
    label = subprocess.run(
        [str(ROOT / "build.sh"), "label"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    site = tmp / "fake-site"
    info = site / f"sglang-0.5.23+{label}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23+{label}\n"
    )
    manifest = {
        "project": "sm120pd",
        "version": f"0.5.23+{label}",
        "label": label,
        "upstream": {"name": "sglang", "version": "0.5.23", "wheel": "x.whl", "sha256": "0" * 64},
        "patches": [],
        "overlay": [],
    }
    (info / "sm120pd_manifest.json").write_text(json.dumps(manifest))
    return site


def run_pd(*args: str, env_extra: dict[str, str] | None = None, timeout: float = 120.0):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run(
        [str(PD), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def processes_using(env_dir: Path) -> list[psutil.Process]:
    return supervise.processes_naming(env_dir)


def kill_all(env_dir: Path, run_dir: Path) -> None:
    supervise.sweep(run_dir, env_dir)


@pytest.fixture
def env_dir(tmp_path: Path) -> Path:
    return make_env_dir(tmp_path)


class SimStack:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.env = make_env_dir(tmp, api_key=SECRET)
        self.run_dir = tmp / "run"
        self.extra = {"PYTHONPATH": str(fake_manifest_path(tmp))}

    def pd(self, *args: str, timeout: float = 120.0):
        return run_pd(
            *args, "--env-dir", str(self.env), "--sim", env_extra=self.extra, timeout=timeout
        )

    def values(self) -> dict[str, str]:
        from launch.pdlib.envfiles import EnvDir

        return EnvDir(self.env).common()

    def url(self, role: str) -> str:
        v = self.values()
        return f"http://127.0.0.1:{v[role.upper() + '_PORT']}"

    def pid(self, role: str) -> int:
        return json.loads((self.run_dir / f"{role}.pid").read_text())["pid"]


@pytest.fixture(scope="module")
def sim_stack(tmp_path_factory):
    stack = SimStack(tmp_path_factory.mktemp("stack"))
    try:
        up = stack.pd("up")
        assert up.returncode == 0, up.stdout + up.stderr
        yield stack
    finally:
        stack.pd("down", timeout=60)
        kill_all(stack.env, stack.run_dir)
