"""A throw-away sim stack for benchmarks: `launch/pd up --sim` on a copy of env/ on loopback.

The copy gets free 127.0.0.1 ports, its own run directory and the sim timing asked for (in
common.env, so both engines read it); the router is the real smg with the env's ROUTER_ARGS.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.lib.stack import Stack, stack_from_env_dir
from launch.pdlib.envfiles import EnvFileError, parse_file, quote, set_values
from launch.pdlib.stack import free_loopback_ports
from launch.pdlib.supervise import sweep

ROOT = Path(__file__).resolve().parents[2]
PD = ROOT / "launch" / "pd"

# Every sim delay at zero: what is left is the processes' own work (router, sim, client).
NEAR_ZERO = {
    "PD_SIM_PREFILL_BASE_S": "0",
    "PD_SIM_PREFILL_PER_TOKEN_S": "0",
    "PD_SIM_DECODE_STEP_BASE_S": "0",
    "PD_SIM_DECODE_STEP_PER_REQ_S": "0",
}


class SimStackError(RuntimeError):
    pass


def set_env_values(path: Path, values: dict[str, str]) -> None:
    """Replace KEY=... lines of an env file (quoted as needed), appending the keys it lacks."""
    try:
        set_values(path, {key: quote(value) for key, value in values.items()})
    except EnvFileError as exc:
        raise SimStackError(str(exc)) from exc


def prepare_env(base: Path, dest: Path, timing: dict[str, str], api_key: str = "") -> Path:
    shutil.copytree(base, dest, ignore=shutil.ignore_patterns("ab", "backups"))
    prefill, boot, decode, router, prom = free_loopback_ports(5)
    set_env_values(
        dest / "common.env",
        {
            "PREFILL_HOST": "127.0.0.1",
            "PREFILL_PORT": str(prefill),
            "PREFILL_BOOTSTRAP_PORT": str(boot),
            "DECODE_HOST": "127.0.0.1",
            "DECODE_PORT": str(decode),
            "ROUTER_HOST": "127.0.0.1",
            "ROUTER_PORT": str(router),
            "ROUTER_PROMETHEUS_PORT": str(prom),
            "PD_RUN_DIR": str(dest.parent / "run"),
            "PD_SUPERVISOR": "local",
            "PD_POLL_INTERVAL_S": "0.2",
            "API_KEY": api_key,
            **timing,
        },
    )
    router_env = dest / "router.env"
    args = {line.key: line.value for line in parse_file(router_env)}.get("ROUTER_ARGS", "")
    # Nothing is in flight when the benchmark stops the router: no long drain.
    set_env_values(router_env, {"ROUTER_ARGS": f"{args} --shutdown-grace-period-secs 1".strip()})
    return dest


def _pd(verb: str, env_dir: Path, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(PD), verb, "--sim", "--env-dir", str(env_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@contextlib.contextmanager
def sim_stack(
    timing: dict[str, str], base: Path = ROOT / "env", api_key: str = ""
) -> Iterator[tuple[Stack, Path]]:
    """Yield the running stack's URLs and its env dir; always brought down afterwards."""
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
        env_dir = prepare_env(base, Path(tmp) / "env", timing, api_key)
        try:
            up = _pd("up", env_dir, 120)
            if up.returncode != 0:
                tail = "\n".join((up.stdout + up.stderr).splitlines()[-15:])
                raise SimStackError(f"launch/pd up --sim failed:\n{tail}")
            yield stack_from_env_dir(env_dir), env_dir
        finally:
            try:
                down = _pd("down", env_dir, 60)
                if down.returncode != 0:
                    print(f"launch/pd down --sim: {(down.stdout + down.stderr).strip()}")
            except subprocess.TimeoutExpired:
                print("launch/pd down --sim did not finish within 60 s")
            finally:
                # A failed or timed-out down must not leave sim engines or a router running.
                left = sweep(Path(tmp) / "run", env_dir)
                if left:
                    print(f"killed {left} process(es) the sim stack left running")
