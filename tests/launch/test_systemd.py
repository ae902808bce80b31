"""systemd supervision: pd drives systemctl (a recording stand-in on PATH) with the same verbs."""

from __future__ import annotations

import os
import re
import subprocess

from launch_harness import ROOT, kill_all, run_pd, set_values

FAKE_SYSTEMCTL = """#!/usr/bin/env bash
set -euo pipefail
printf '%s\\n' "$*" >> "$FAKE_SYSTEMCTL_LOG"
case "$1" in
  is-active) echo "${FAKE_ACTIVE:-active}" ;;
  show) echo 4242 ;;
  restart) sleep "${FAKE_RESTART_SLEEP:-0}" ;;
esac
"""


def fake_path(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "systemctl"
    tool.write_text(FAKE_SYSTEMCTL)
    tool.chmod(0o755)
    log = tmp_path / "systemctl.log"
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SYSTEMCTL_LOG": str(log)}, log


def calls(log):
    return log.read_text().splitlines() if log.exists() else []


def test_down_and_status_drive_systemctl_in_order(env_dir, tmp_path):
    set_values(env_dir / "common.env", PD_SUPERVISOR="systemd", PD_UNIT_PREFIX="t1")
    extra, log = fake_path(tmp_path)
    down = run_pd("down", "--env-dir", str(env_dir), env_extra=extra)
    assert down.returncode == 0, down.stderr
    stops = [c for c in calls(log) if c.startswith("stop")]
    assert stops == ["stop t1-router.service", "stop t1-decode.service", "stop t1-prefill.service"]
    status = run_pd("status", "decode", "--env-dir", str(env_dir), env_extra=extra)
    assert "unit t1-decode.service active, pid 4242" in status.stdout
    assert status.returncode == 1  # nothing answers the health URL


def test_a_restart_that_times_out_is_checked_not_reissued(env_dir, tmp_path):
    set_values(env_dir / "common.env", PD_SUPERVISOR="systemd", PD_SYSTEMCTL_TIMEOUT_S="1")
    extra, log = fake_path(tmp_path)
    extra["FAKE_RESTART_SLEEP"] = "5"
    # The unit "came up" despite the slow systemctl: a simulated decode owns the port.
    server = subprocess.Popen(
        [str(ROOT / "launch" / "decode.sh"), "--env-dir", str(env_dir), "--sim"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        done = run_pd(
            "restart", "decode", "--env-dir", str(env_dir), "--timeout", "20", env_extra=extra
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "systemctl restart timed out after 1 s" in done.stdout
        assert "carrying on" in done.stdout and "healthy after" in done.stdout
        assert [c for c in calls(log) if c.startswith("restart")] == [
            "restart sm120pd-decode.service"
        ]
        assert "is-active sm120pd-decode.service" in calls(log)
    finally:
        server.kill()
        server.wait(timeout=10)
        kill_all(env_dir, tmp_path / "run")


def test_a_timed_out_restart_of_an_inactive_unit_fails_without_retrying(env_dir, tmp_path):
    set_values(env_dir / "common.env", PD_SUPERVISOR="systemd", PD_SYSTEMCTL_TIMEOUT_S="1")
    extra, log = fake_path(tmp_path)
    extra.update(FAKE_RESTART_SLEEP="5", FAKE_ACTIVE="failed")
    done = run_pd("co-restart", "--env-dir", str(env_dir), env_extra=extra)
    assert done.returncode == 1
    assert "timed out after 1 s and the unit is unit sm120pd-prefill.service failed" in done.stderr
    assert "co-restart stopped at prefill" in done.stderr
    assert [c for c in calls(log) if c.startswith("restart")] == ["restart sm120pd-prefill.service"]


def test_units_render_with_this_checkout_and_env_dir(env_dir, tmp_path):
    out = tmp_path / "units"
    done = run_pd("units", "--out", str(out), "--env-dir", str(env_dir), "--sim")
    assert done.returncode == 0, done.stderr
    decode = (out / "sm120pd-decode.service").read_text()
    assert f"ExecStart={ROOT}/launch/decode.sh --env-dir {env_dir.resolve()} --sim" in decode
    assert f"EnvironmentFile={env_dir.resolve()}/decode.env" in decode
    assert "After=network-online.target sm120pd-prefill.service" in decode
    assert not re.search(r"@[A-Z_]+@", decode)
