import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.pdlib import envfiles, supervise  # noqa: E402
from launch.pdlib.stack import free_loopback_ports  # noqa: E402

# The smallest honest bench/ab run: one request per C, short prompts and outputs, one warm-up.
TINY_AB_LOAD = [
    "--requests-per-c",
    "1",
    "--input-words",
    "8",
    "--output-tokens",
    "4",
    "--warmup",
    "1",
    "--no-progress",
]


def free_port() -> int:
    return free_loopback_ports(1)[0]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} not answering after {timeout_s} s")


class Processes:
    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, ready_url: str | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        if ready_url:
            wait_http(ready_url, proc)
        return proc

    def stop_all(self):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)


@pytest.fixture
def procs():
    p = Processes()
    yield p
    p.stop_all()


@pytest.fixture
def fake_engine(procs):
    """URL of a fake streaming chat server (1 ms per token)."""

    def start(token_ms: float = 1.0) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs.start(
            "tests/bench/fake_engine.py",
            "--port",
            str(port),
            "--token-ms",
            str(token_ms),
            ready_url=url + "/v1/models",
        )
        return url

    return start


@pytest.fixture
def fault_proxy(procs):
    def start(upstream: str, *flags: str) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs.start(
            "bench/proxy",
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream",
            upstream,
            *flags,
            ready_url=url + "/v1/models",
        )
        return url

    return start


def run_tool(
    *args: str, timeout_s: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a tool; `env` replaces the environment (default: this process's)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )


def env_with_api_key(key: str | None) -> dict[str, str]:
    """This process's environment with API_KEY set to `key`, or removed for None."""
    env = {k: v for k, v in os.environ.items() if k not in ("API_KEY", "OPENAI_API_KEY")}
    if key is not None:
        env["API_KEY"] = key
    return env


def set_env_values(path: Path, **values: str) -> None:
    """Replace KEY=... lines of an env file, appending the keys it does not have, verbatim."""
    envfiles.set_values(path, values)


def copy_env_dir(dest: Path, **common: str) -> Path:
    """The repository's env/ (without the A/B overlays) with some common.env values replaced."""
    shutil.copytree(ROOT / "env", dest, ignore=shutil.ignore_patterns("ab", "backups", "cpu*"))
    set_env_values(dest / "common.env", **common)
    return dest


PD = ROOT / "launch" / "pd"


class SimStack:
    """launch/pd --sim on a copy of env/ with free loopback ports and its own run dir."""

    def __init__(self, tmp: Path, decode_env: dict[str, str] | None = None, api_key: str = ""):
        self.tmp = tmp
        prefill, boot, decode, router, prom = free_loopback_ports(5)
        self.run_dir = tmp / "run"
        self.env = copy_env_dir(
            tmp / "env",
            PREFILL_HOST="127.0.0.1",
            PREFILL_PORT=str(prefill),
            PREFILL_BOOTSTRAP_PORT=str(boot),
            DECODE_HOST="127.0.0.1",
            DECODE_PORT=str(decode),
            ROUTER_HOST="127.0.0.1",
            ROUTER_PORT=str(router),
            ROUTER_PROMETHEUS_PORT=str(prom),
            PD_RUN_DIR=str(self.run_dir),
            PD_SUPERVISOR="local",
            PD_POLL_INTERVAL_S="0.2",
            API_KEY=api_key,
        )
        # Faster health checks, and no long drain on stop: every down and co-restart stops the
        # router, and the tests have nothing in flight then.
        set_env_values(
            self.env / "router.env",
            ROUTER_ARGS='"--policy round_robin --health-check-interval-secs 1 '
            '--worker-startup-check-interval 1 --shutdown-grace-period-secs 1"',
        )
        if decode_env:
            set_env_values(self.env / "decode.env", **decode_env)

    def pd(self, verb: str, timeout_s: float = 90.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(PD), verb, "--sim", "--env-dir", str(self.env)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def kill_leftovers(self) -> None:
        """Whatever `down` missed: recorded pids and any process naming this stack's tmp dir
        (which holds the arms' env copies too)."""
        supervise.sweep(self.run_dir, self.tmp)


@contextlib.contextmanager
def sim_stack_up(tmp: Path, decode_env: dict[str, str] | None = None, api_key: str = ""):
    """A running sim stack (launch/pd up --sim), brought down and swept afterwards."""
    stack = SimStack(tmp, decode_env, api_key)
    try:
        up = stack.pd("up")
        assert up.returncode == 0, up.stdout + up.stderr
        yield stack
    finally:
        try:
            stack.pd("down", timeout_s=60)
        finally:
            stack.kill_leftovers()


@pytest.fixture(scope="module")
def sim_stack(tmp_path_factory):
    with sim_stack_up(tmp_path_factory.mktemp("sim")) as stack:
        yield stack
