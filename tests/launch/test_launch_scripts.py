"""The per-role scripts: the exact command lines, and --dry-run never shows the secret."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from launch_harness import ROOT, SECRET, set_values


def dry_run(role, env_dir, *extra):
    return subprocess.run(
        [str(ROOT / "launch" / f"{role}.sh"), "--env-dir", str(env_dir), "--dry-run", *extra],
        capture_output=True,
        text=True,
        timeout=30,
    )


def command_of(done) -> str:
    lines = done.stdout.splitlines()
    return lines[lines.index("# command") + 1]


def test_prefill_command_is_sglang_in_prefill_mode_with_bootstrap_port(env_dir):
    done = dry_run("prefill", env_dir)
    assert done.returncode == 0, done.stderr
    cmd = command_of(done)
    assert "-m sglang.launch_server" in cmd
    assert "--disaggregation-mode prefill" in cmd
    assert "--disaggregation-transfer-backend nixl" in cmd
    assert "--chunked-prefill-size 8192" in cmd
    assert "SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT=60" in done.stdout


def test_decode_command_carries_decode_mode_and_its_knob_in_the_environment(env_dir):
    done = dry_run("decode", env_dir)
    cmd = command_of(done)
    assert "--disaggregation-mode decode" in cmd and "prefill" not in cmd
    assert "SGLANG_SM120_MMA_TARGET_CTAS=512" in done.stdout
    assert "SGLANG_SM120_FLASHMLA_BACKEND=mma" in done.stdout


def test_sim_swaps_only_the_engine_program(env_dir):
    real = command_of(dry_run("decode", env_dir)).split()
    sim = command_of(dry_run("decode", env_dir, "--sim")).split()
    assert real[1:3] == ["-m", "sglang.launch_server"]
    assert sim[1].endswith("launch/sim_engine.py")
    assert real[3:] == sim[2:]


def test_router_command_is_smg_pd_with_both_engines(env_dir):
    cmd = command_of(dry_run("router", env_dir))
    v = dict(
        ln.split("=", 1)
        for ln in (env_dir / "common.env").read_text().splitlines()
        if ln and not ln.startswith("#")
    )
    assert "launch --pd-disaggregation" in cmd
    assert f"--prefill http://127.0.0.1:{v['PREFILL_PORT']} {v['PREFILL_BOOTSTRAP_PORT']}" in cmd
    assert f"--decode http://127.0.0.1:{v['DECODE_PORT']}" in cmd


def test_router_passes_the_shutdown_grace_from_router_env_to_smg(env_dir):
    from launch.pdlib.envfiles import EnvDir

    shipped = EnvDir(env_dir).role_env("router")["ROUTER_SHUTDOWN_GRACE_S"]
    assert shipped.isdigit()
    done = dry_run("router", env_dir)
    assert f"--shutdown-grace-period-secs {shipped} " in command_of(done) + " "
    assert f"ROUTER_SHUTDOWN_GRACE_S={shipped}" in done.stdout.splitlines()
    set_values(env_dir / "router.env", ROUTER_SHUTDOWN_GRACE_S=str(int(shipped) + 5))
    cmd = command_of(dry_run("router", env_dir))
    assert f"--shutdown-grace-period-secs {int(shipped) + 5} " in cmd + " "
    assert cmd.count("--shutdown-grace-period-secs") == 1
    # Empty: no flag, so smg's own default applies.
    set_values(env_dir / "router.env", ROUTER_SHUTDOWN_GRACE_S="")
    assert "--shutdown-grace-period-secs" not in command_of(dry_run("router", env_dir))


def test_router_puts_its_prometheus_endpoint_on_the_router_host_unless_told_otherwise(env_dir):
    """smg alone binds its Prometheus endpoint to every interface; the script gives it
    ROUTER_PROMETHEUS_HOST when that is set, else ROUTER_HOST."""
    assert "--prometheus-host 127.0.0.1 " in command_of(dry_run("router", env_dir)) + " "
    set_values(env_dir / "common.env", ROUTER_HOST="localhost")
    assert "--prometheus-host localhost " in command_of(dry_run("router", env_dir)) + " "
    set_values(env_dir / "router.env", ROUTER_PROMETHEUS_HOST="0.0.0.0")
    done = dry_run("router", env_dir)
    assert "--prometheus-host 0.0.0.0 " in command_of(done) + " "
    assert "ROUTER_PROMETHEUS_HOST=0.0.0.0" in done.stdout.splitlines()


def test_router_refuses_a_shutdown_grace_smg_would_reject(env_dir):
    set_values(env_dir / "router.env", ROUTER_SHUTDOWN_GRACE_S="1.5")
    done = dry_run("router", env_dir)
    assert done.returncode == 2
    assert "ROUTER_SHUTDOWN_GRACE_S=1.5: must be a whole number of seconds" in done.stderr
    assert "# command" not in done.stdout


@pytest.mark.parametrize(
    "role, flag, name",
    [
        ("prefill", "--config", "prefill.yaml"),
        ("decode", "--config", "decode.yaml"),
        ("router", "--api-key-file", "router.key"),
    ],
)
def test_the_api_key_goes_through_a_private_file_not_the_command_line(env_dir, role, flag, name):
    set_values(env_dir / "common.env", API_KEY=SECRET)
    done = dry_run(role, env_dir)
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert "API_KEY=<redacted>" in done.stdout
    words = shlex.split(command_of(done))
    assert "--api-key" not in words
    run_dir = env_dir.parent / "run"
    assert words[words.index(flag) + 1] == str(run_dir / "secrets" / name)
    if role == "router":
        assert words[1] == str(ROOT / "launch" / "smg_keyfile.py")
    # A dry run prints the command and writes nothing.
    assert not (run_dir / "secrets").exists()


def test_smg_keyfile_puts_the_key_after_the_subcommand_and_refuses_a_missing_file(tmp_path):
    sys.path.insert(0, str(ROOT / "launch"))
    from smg_keyfile import router_argv

    key = tmp_path / "router.key"
    key.write_text(SECRET + "\n")
    argv = ["--api-key-file", str(key), "launch", "--port", "1"]
    assert router_argv(argv) == ["launch", "--api-key", SECRET, "--port", "1"]
    with pytest.raises(SystemExit, match="cannot read the API key file"):
        router_argv(["--api-key-file", str(tmp_path / "absent"), "launch"])
    key.write_text("\n")
    with pytest.raises(SystemExit, match="is empty"):
        router_argv(argv)


def test_router_refuses_a_key_it_cannot_keep_off_a_non_python_smg(env_dir, tmp_path):
    smg = tmp_path / "smg"
    smg.write_text("\x7fELF")
    set_values(env_dir / "common.env", API_KEY=SECRET)
    set_values(env_dir / "router.env", SMG_BIN=str(smg))
    done = dry_run("router", env_dir)
    assert done.returncode == 2
    assert "is not a Python console script" in done.stderr
    assert SECRET not in done.stdout + done.stderr


def test_unknown_argument_is_refused(env_dir):
    done = dry_run("decode", env_dir, "--bogus")
    assert done.returncode == 2
    assert "unknown argument: --bogus" in done.stderr


WRITE_SECRET = r"""
source "$1/launch/lib.sh"
DRY_RUN=0
write_secret "$2" "$3"
"""


def write_secret(path, text):
    return subprocess.run(
        ["bash", "-c", WRITE_SECRET, "bash", str(ROOT), str(path), text],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_secret_file_replaces_a_planted_link_and_goes_only_into_a_directory_of_ours(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    secrets = tmp_path / "run" / "secrets"
    secrets.mkdir(parents=True)
    secrets.chmod(0o777)
    target = secrets / "router.key"
    target.symlink_to(victim)
    done = write_secret(target, SECRET)
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "precious\n"
    assert not target.is_symlink() and target.read_text() == SECRET + "\n"
    assert target.stat().st_mode & 0o777 == 0o600 and secrets.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in secrets.iterdir()] == ["router.key"]
    # A secrets directory that is a link, or (as root) another user's, is refused.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "secrets").symlink_to(elsewhere)
    done = write_secret(tmp_path / "run2" / "secrets" / "prefill.yaml", SECRET)
    assert done.returncode == 2 and "not a directory of this user's own" in done.stderr
    assert list(elsewhere.iterdir()) == []
    if os.geteuid() == 0:
        theirs = tmp_path / "run3" / "secrets"
        theirs.mkdir(parents=True)
        os.chown(theirs, 65534, 65534)
        done = write_secret(theirs / "decode.yaml", SECRET)
        assert done.returncode == 2 and list(theirs.iterdir()) == []
