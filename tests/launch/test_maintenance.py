"""launch/pdlib/maintenance.py: the marks launch/pd writes for Prometheus while it stops, starts
or restarts an instance. The file is read back with prometheus_client's own parser, as
node_exporter's textfile collector would serve it; the live side (co-restart under marks, no
PDInstanceDown) is in tests/engine/test_cpu_engines.py."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import pytest
from launch_harness import ROOT, set_values
from prometheus_client.parser import text_string_to_metric_families

from launch.pdlib import maintenance
from launch.pdlib.stack import load_stack


def env_copy(tmp: Path, textfile_dir: str | None) -> Path:
    env = tmp / "env"
    shutil.copytree(ROOT / "env" / "cpu", env)
    values = {"PD_RUN_DIR": str(tmp / "run")}
    if textfile_dir is not None:
        values[maintenance.VARIABLE] = textfile_dir
    set_values(env / "common.env", **values)
    return env


def samples(path: Path) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            assert sample.name == maintenance.METRIC
            assert sample.labels["stack"] == "sm120pd-cpu"
            out[sample.labels["pd_instance"]] = sample.value
    return out


def test_marks_for_a_start_a_stop_and_service(tmp_path):
    (tmp_path / "textfile").mkdir()
    stack = load_stack(env_copy(tmp_path, str(tmp_path / "textfile")), sim=False)
    decode, router = stack.role("decode"), stack.role("router")
    before = time.time()
    assert maintenance.starting(stack, decode) is None
    assert maintenance.stopped(stack, router) is None
    path = maintenance.textfile(stack)
    assert path == tmp_path / "textfile" / "sm120pd_maintenance_sm120pd-cpu.prom"
    got = samples(path)
    # decode: its health timeout (env/cpu: 300 s) and the margin from now, rounded up to the ms
    assert before + 300 + 60 <= got["decode"] <= time.time() + 300 + 60 + 0.001
    assert math.isinf(got["router"]) and got["router"] > 0
    assert maintenance.in_service(stack, decode) is None
    assert samples(path) == {"decode": 0.0, "router": math.inf}
    assert maintenance.read(stack) == {"decode": 0.0, "router": math.inf}
    assert path.stat().st_mode & 0o777 == 0o644
    assert (stack.run_dir / "maintenance.json").stat().st_mode & 0o777 == 0o600


def test_a_rolling_restart_mark_covers_the_drain_too(tmp_path):
    (tmp_path / "textfile").mkdir()
    stack = load_stack(env_copy(tmp_path, str(tmp_path / "textfile")), sim=False)
    before = time.time()
    maintenance.starting(stack, stack.role("decode"), extra_s=840)
    assert samples(maintenance.textfile(stack))["decode"] >= before + 300 + 840 + 60


def test_no_textfile_dir_no_mark_and_a_sim_stack_never_marks(tmp_path):
    stack = load_stack(env_copy(tmp_path, None), sim=False)
    assert maintenance.textfile(stack) is None
    assert maintenance.stopped(stack, stack.role("decode")) is None
    assert maintenance.read(stack) == {}
    (tmp_path / "textfile").mkdir()
    sim = load_stack(env_copy(tmp_path / "sim", str(tmp_path / "textfile")), sim=True)
    assert maintenance.stopped(sim, sim.role("decode")) is None
    assert list((tmp_path / "textfile").iterdir()) == []


def test_a_missing_textfile_dir_is_said_and_the_state_is_kept(tmp_path):
    stack = load_stack(env_copy(tmp_path, str(tmp_path / "nowhere")), sim=False)
    problem = maintenance.stopped(stack, stack.role("decode"))
    assert problem == (
        f"PD_TEXTFILE_DIR={tmp_path / 'nowhere'}: no such directory; maintenance mark not written"
    )
    assert maintenance.read(stack) == {"decode": math.inf}


def test_a_run_dir_of_another_user_is_refused(tmp_path, monkeypatch):
    (tmp_path / "textfile").mkdir()
    stack = load_stack(env_copy(tmp_path, str(tmp_path / "textfile")), sim=False)
    stack.run_dir.mkdir(mode=0o700)
    monkeypatch.setattr("os.geteuid", lambda: 4242)
    with pytest.raises(Exception, match="belongs to uid"):
        maintenance.stopped(stack, stack.role("decode"))
