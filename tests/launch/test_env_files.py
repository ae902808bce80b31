"""env check, env diff, snapshot/restore: the checks that run before anything is launched."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

from launch_harness import ROOT, SECRET, processes_using, run_pd, set_values


def env_check(env_dir):
    return run_pd("env", "check", "--env-dir", str(env_dir))


def test_shipped_env_files_pass_env_check():
    done = run_pd("env", "check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "env check" in done.stdout and "ok" in done.stdout


def test_env_check_flags_a_misspelt_knob_and_names_the_right_one(env_dir):
    set_values(env_dir / "decode.env", SGLANG_SM120_MMA_TARGET_CTA="512")
    done = env_check(env_dir)
    assert done.returncode == 1
    line = next(ln for ln in done.stdout.splitlines() if "SGLANG_SM120_MMA_TARGET_CTA " in ln)
    assert "did you mean SGLANG_SM120_MMA_TARGET_CTAS" in line
    assert "decode.env" in line


def test_env_check_rejects_values_our_knobs_would_reject(env_dir):
    set_values(env_dir / "decode.env", SGLANG_SM120_MMA_TARGET_CTAS="-1")
    set_values(env_dir / "prefill.env", SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT="0")
    set_values(env_dir / "common.env", SGLANG_SM120_FLASHMLA_BACKEND="cutlass")
    done = env_check(env_dir)
    assert done.returncode == 1
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 3, done.stdout
    assert any("SGLANG_SM120_MMA_TARGET_CTAS='-1'" in ln for ln in fails)
    assert any("SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT='0'" in ln for ln in fails)
    assert any("SGLANG_SM120_FLASHMLA_BACKEND='cutlass'" in ln for ln in fails)


def test_env_check_accepts_every_value_our_knobs_accept(env_dir):
    set_values(env_dir / "decode.env", SGLANG_SM120_MMA_TARGET_CTAS="auto")
    set_values(env_dir / "prefill.env", SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT="2.5")
    for backend in ("flashinfer", "triton", "torch", "mma"):
        set_values(env_dir / "common.env", SGLANG_SM120_FLASHMLA_BACKEND=backend)
        done = env_check(env_dir)
        assert done.returncode == 0, done.stdout


def test_env_check_wants_the_router_shutdown_grace_in_whole_seconds(env_dir):
    for good in ("0", "2", "30", ""):
        set_values(env_dir / "router.env", ROUTER_SHUTDOWN_GRACE_S=good)
        done = env_check(env_dir)
        assert done.returncode == 0, (good, done.stdout)
    for bad in ("1.5", "-1", "2s"):
        set_values(env_dir / "router.env", ROUTER_SHUTDOWN_GRACE_S=bad)
        done = env_check(env_dir)
        assert done.returncode == 1, bad
        fail = next(ln for ln in done.stdout.splitlines() if ln.startswith("FAIL"))
        assert f"ROUTER_SHUTDOWN_GRACE_S={bad!r}: must be a whole number of seconds" in fail


def test_env_check_wants_the_routers_prometheus_host_bare_and_resolvable(env_dir):
    for good in ("localhost", "0.0.0.0"):
        set_values(env_dir / "router.env", ROUTER_PROMETHEUS_HOST=good)
        done = env_check(env_dir)
        assert done.returncode == 0, (good, done.stdout)
    for bad, said in (
        ("127.0.0.1:29000", "='127.0.0.1:29000': must be a host name or an IP address"),
        ("metrics.invalid", ": host 'metrics.invalid' of the router's Prometheus endpoint does"),
    ):
        set_values(env_dir / "router.env", ROUTER_PROMETHEUS_HOST=bad)
        done = env_check(env_dir)
        assert done.returncode == 1, bad
        fail = next(ln for ln in done.stdout.splitlines() if ln.startswith("FAIL"))
        assert fail.startswith(f"FAIL {env_dir / 'router.env'}:"), fail
        assert f"ROUTER_PROMETHEUS_HOST{said}" in fail, fail


def test_env_check_wants_each_engines_sglang_host_ip_on_its_own_host(env_dir):
    """SGLANG_HOST_IP is where an engine's PD sockets listen and where the other engines are
    told to reach them: an address that is not the engine's host is refused."""
    set_values(env_dir / "decode.env", SGLANG_HOST_IP="192.0.2.77")
    done = env_check(env_dir)
    assert done.returncode == 1, done.stdout
    fail = next(ln for ln in done.stdout.splitlines() if "SGLANG_HOST_IP" in ln)
    assert fail.startswith(f"FAIL {env_dir / 'decode.env'}:"), fail
    assert "SGLANG_HOST_IP=192.0.2.77: decode's PD sockets would listen there" in fail
    assert "DECODE_HOST=127.0.0.1" in fail
    set_values(env_dir / "decode.env", SGLANG_HOST_IP="localhost")
    assert env_check(env_dir).returncode == 0


def test_env_check_rejects_lines_bash_and_systemd_would_read_differently(env_dir):
    for bad in ("export FOO=1", "FOO=two words", 'FOO="$HOME/x"', "FOO=1 # note"):
        with (env_dir / "router.env").open("a") as f:
            f.write(bad + "\n")
        done = env_check(env_dir)
        assert done.returncode == 1, bad
        assert "router.env" in done.stdout, done.stdout
        shutil.copy(ROOT / "env" / "router.env", env_dir / "router.env")


def test_env_check_never_prints_a_secret_from_a_bad_line(env_dir):
    with (env_dir / "common.env").open("a") as f:
        f.write(f"HF_TOKEN={SECRET} trailing\n")
    done = env_check(env_dir)
    assert done.returncode == 1
    assert SECRET not in done.stdout + done.stderr


def test_env_diff_of_the_ab_overlays_is_the_one_knob_line():
    done = run_pd("env", "diff", str(ROOT / "env/ab/A.env"), str(ROOT / "env/ab/B.env"))
    assert done.returncode == 0
    assert "SGLANG_SM120_MMA_TARGET_CTAS=auto" in done.stdout
    assert "SGLANG_SM120_MMA_TARGET_CTAS=512" in done.stdout
    assert "1 line(s) differ" in done.stdout


BACKEND_ARMS = {"flashinfer": "flashinfer.env", "mma": "mma.env"}


def test_the_backend_ab_arms_differ_only_in_the_backend_and_env_check_takes_each(env_dir, tmp_path):
    """env/ab/backend: upstream's FlashInfer kernel against ours, the A/B that decides
    common.env's default. Each arm is applied as bench/ab applies it and must pass env check."""
    from bench.lib.arms import apply_overlay
    from launch.pdlib import envfiles

    backend_dir = ROOT / "env" / "ab" / "backend"
    assert sorted(p.name for p in backend_dir.iterdir()) == sorted(BACKEND_ARMS.values())
    done = run_pd("env", "diff", *(str(backend_dir / name) for name in BACKEND_ARMS.values()))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 line(s) differ" in done.stdout, done.stdout
    for value, name in BACKEND_ARMS.items():
        lines = envfiles.parse_file(backend_dir / name)
        assert [(ln.key, ln.value) for ln in lines] == [("SGLANG_SM120_FLASHMLA_BACKEND", value)]
        assert envfiles.knob_value_error("SGLANG_SM120_FLASHMLA_BACKEND", value) is None
        arm = tmp_path / f"env-{value}"
        apply_overlay(env_dir, backend_dir / name, arm)
        # The overlay replaces common.env's line (nothing appended): both engines run the arm.
        assert "added by bench/ab" not in (arm / "decode.env").read_text()
        for role in ("prefill", "decode"):
            assert envfiles.EnvDir(arm).role_env(role)["SGLANG_SM120_FLASHMLA_BACKEND"] == value
        checked = env_check(arm)
        assert checked.returncode == 0, checked.stdout


def test_common_env_names_the_ab_that_decides_its_backend():
    """The default backend's comment names the A/B that decides it, with files that exist."""
    lines = (ROOT / "env" / "common.env").read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("SGLANG_SM120_FLASHMLA_BACKEND="))
    above = []
    for ln in reversed(lines[:at]):
        if not ln.startswith("#"):
            break
        above.append(ln)
    command = next(ln.lstrip("# ") for ln in above if ln.startswith("# bench/ab "))
    words = command.split()
    overlays = [words[words.index(flag) + 1] for flag in ("--a", "--b")]
    assert overlays == [f"env/ab/backend/{name}" for name in BACKEND_ARMS.values()]
    assert all((ROOT / path).is_file() for path in overlays)


def test_env_diff_of_two_dirs_shows_only_changed_keys_and_redacts_secrets(env_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(env_dir, other)
    set_values(other / "decode.env", SGLANG_SM120_MMA_TARGET_CTAS="256")
    set_values(other / "common.env", API_KEY=SECRET)
    done = run_pd("env", "diff", str(env_dir), str(other))
    assert "2 line(s) differ" in done.stdout, done.stdout
    assert "SGLANG_SM120_MMA_TARGET_CTAS=256" in done.stdout
    assert SECRET not in done.stdout


def test_snapshot_then_restore_brings_back_the_old_files(env_dir):
    before = (env_dir / "decode.env").read_text()
    snap = run_pd("env", "snapshot", "--env-dir", str(env_dir))
    assert snap.returncode == 0, snap.stderr
    set_values(env_dir / "decode.env", SGLANG_SM120_MMA_TARGET_CTAS="128")
    name = snap.stdout.split()[-1].rsplit("/", 1)[-1]
    done = run_pd("env", "restore", name, "--env-dir", str(env_dir))
    assert done.returncode == 0, done.stderr
    assert (env_dir / "decode.env").read_text() == before
    listing = run_pd("env", "restore", "--list", "--env-dir", str(env_dir)).stdout.split()
    assert name in listing and len(listing) == 2


def test_restore_of_an_unknown_snapshot_fails_and_changes_nothing(env_dir):
    run_pd("env", "snapshot", "--env-dir", str(env_dir))
    before = (env_dir / "decode.env").read_text()
    done = run_pd("env", "restore", "no-such", "--env-dir", str(env_dir))
    assert done.returncode == 2
    assert "no snapshot 'no-such'" in done.stderr
    assert (env_dir / "decode.env").read_text() == before


def test_a_missing_env_dir_is_a_clear_error():
    done = run_pd("status", "--env-dir", "/nonexistent/env")
    assert done.returncode == 2
    assert "not a directory" in done.stderr


def test_env_check_wants_the_decode_waiting_timeout_as_positive_whole_seconds(env_dir):
    # Upstream's registry would warn and fall back to 300 s on these.
    for good in ("300", "60"):
        set_values(env_dir / "decode.env", SGLANG_DISAGGREGATION_WAITING_TIMEOUT=good)
        assert env_check(env_dir).returncode == 0, good
    for bad in ("0", "-1", "30s", "2.5", ""):
        set_values(env_dir / "decode.env", SGLANG_DISAGGREGATION_WAITING_TIMEOUT=bad)
        done = env_check(env_dir)
        assert done.returncode == 1, bad
        fail = next(ln for ln in done.stdout.splitlines() if ln.startswith("FAIL"))
        assert f"SGLANG_DISAGGREGATION_WAITING_TIMEOUT={bad!r}" in fail
        assert "positive whole number of seconds" in fail


def test_env_check_refuses_engine_flags_sglang_refuses_naming_file_variable_and_flag(env_dir):
    # What a new user tried: a misspelled flag and a wrong transfer backend in DECODE_ARGS.
    set_values(
        env_dir / "decode.env",
        DECODE_ARGS='"--mem-fraction-statc 0.85 --disaggregation-transfer-backend nixxl"',
    )
    done = env_check(env_dir)
    assert done.returncode == 1, done.stdout
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 2, done.stdout
    statc, backend = sorted(fails, key=lambda ln: "statc" not in ln)
    for line in fails:
        assert "decode.env:" in line and "DECODE_ARGS" in line
    assert "--mem-fraction-statc" in statc and "unrecognized arguments" in statc
    assert "--disaggregation-transfer-backend" in backend and "'nixxl'" in backend


def test_the_cpu_tp_thread_binding_that_upstream_reads_outside_its_registry_is_known(env_dir):
    """sglang's numa_utils reads SGLANG_CPU_OMP_THREADS_BIND with os.environ (a CPU engine at
    TP > 1 on one NUMA node needs it), so the registry alone would call it a typo."""
    sglang_dir = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    numa_utils = (sglang_dir / "srt" / "utils" / "numa_utils.py").read_text()
    assert 'os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"' in numa_utils
    set_values(env_dir / "decode.env", SGLANG_CPU_OMP_THREADS_BIND='"0|1"')
    done = env_check(env_dir)
    assert done.returncode == 0, done.stdout
    set_values(env_dir / "decode.env", SGLANG_CPU_OMP_THREADS_BIN='"0|1"')
    typo = env_check(env_dir)
    assert typo.returncode == 1 and "SGLANG_CPU_OMP_THREADS_BIN is not a knob" in typo.stdout


def test_a_misspelt_flag_without_a_value_at_the_end_of_the_line_is_named_once(env_dir):
    """argparse stops at the first refusal, so each refused flag is taken out and the line
    parsed again: a flag with no value after it, not first on the line, must go alone."""
    set_values(env_dir / "decode.env", DECODE_ARGS='"--mem-fraction-static 0.85 --enable-metrix"')
    done = env_check(env_dir)
    assert done.returncode == 1, done.stdout
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1, done.stdout
    assert "--enable-metrix" in fails[0] and "DECODE_ARGS" in fails[0]


def test_env_check_traces_a_refused_flag_to_the_variable_that_built_it(env_dir):
    set_values(env_dir / "common.env", TRANSFER_BACKEND="nixxl")
    done = env_check(env_dir)
    assert done.returncode == 1
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL")]
    # Both engines get --disaggregation-transfer-backend from common.env's TRANSFER_BACKEND.
    assert len(fails) == 2 and all("common.env:" in ln and "TRANSFER_BACKEND" in ln for ln in fails)
    assert {"prefill", "decode"} == {
        role for ln in fails for role in ("prefill", "decode") if f"the {role} engine" in ln
    }


def test_env_check_accepts_every_flag_sglang_accepts(env_dir):
    set_values(
        env_dir / "prefill.env",
        PREFILL_ARGS='"--trust-remote-code --mem-fraction-static 0.8 --chunked-prefill-size 4096 '
        '--disable-overlap-schedule --disaggregation-decode-retraction-backup cpu_tensor"',
    )
    done = env_check(env_dir)
    assert done.returncode == 0, done.stdout


def test_sim_engine_refuses_what_sglang_refuses():
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "sim_engine.py"),
            "--model-path",
            "m",
            "--mem-fraction-statc",
            "0.85",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "unrecognized arguments: --mem-fraction-statc 0.85" in done.stderr


def _model(tmp_path, model_type: str):
    model = tmp_path / f"model-{model_type}"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": model_type}))
    return model


def test_env_check_and_up_refuse_prefill_and_decode_on_different_models(env_dir):
    set_values(env_dir / "decode.env", MODEL_PATH="deepseek-ai/DeepSeek-V4-Pro")
    done = env_check(env_dir)
    assert done.returncode == 1
    line = next(ln for ln in done.stdout.splitlines() if "must serve the same model" in ln)
    assert "decode.env" in line and "MODEL_PATH=deepseek-ai/DeepSeek-V4-Pro" in line
    assert "common.env" in line and "MODEL_PATH=deepseek-ai/DeepSeek-V4-Flash" in line
    # up refuses before it starts anything (it does not run the whole env check).
    up = run_pd("up", "--env-dir", str(env_dir), "--sim")
    assert up.returncode == 2, up.stdout + up.stderr
    assert "must serve the same model" in up.stderr and "up: nothing started" in up.stderr
    assert not list((env_dir.parent / "run").glob("*.pid"))
    assert processes_using(env_dir) == []
    # So does every other verb that (re)starts an engine.
    for verb in (["restart", "decode"], ["co-restart"], ["rolling-restart", "decode"]):
        done = run_pd(*verb, "--env-dir", str(env_dir), "--sim")
        assert done.returncode == 2, done.stdout + done.stderr
        assert "must serve the same model" in done.stderr
        assert f"{verb[0]}: nothing started or stopped" in done.stderr
    assert not list((env_dir.parent / "run").glob("*.pid"))
    assert processes_using(env_dir) == []


def test_env_check_and_up_refuse_the_dsv4_path_on_a_model_that_is_not_dsv4(env_dir, tmp_path):
    set_values(env_dir / "common.env", SGLANG_USE_CPU_ENGINE="1")  # the path is for CPU engines
    llama = _model(tmp_path, "llama")
    set_values(env_dir / "common.env", MODEL_PATH=str(llama))
    set_values(env_dir / "decode.env", SGLANG_CPU_SM120_PATH="1")
    done = env_check(env_dir)
    assert done.returncode == 1
    line = next(ln for ln in done.stdout.splitlines() if "SGLANG_CPU_SM120_PATH" in ln)
    assert "decode.env" in line and "model_type 'llama'" in line
    up = run_pd("up", "--env-dir", str(env_dir), "--sim")
    assert up.returncode == 2 and "model_type 'llama'" in up.stderr
    assert processes_using(env_dir) == []
    # The same setting next to a DSV4 model passes this check.
    set_values(env_dir / "common.env", MODEL_PATH=str(_model(tmp_path, "deepseek_v4")))
    assert "SGLANG_CPU_SM120_PATH" not in env_check(env_dir).stdout


CPU_ONLY = "SGLANG_DISAGGREGATION_NIXL_THREAD_NICE"


def test_env_check_and_up_refuse_cpu_only_settings_on_engines_that_are_not_cpu_engines(env_dir):
    # The shipped GPU env files: no SGLANG_USE_CPU_ENGINE. Patch 0020's knob on decode is refused
    # naming the file, its line and the variable (the engine would stop at start).
    set_values(env_dir / "decode.env", **{CPU_ONLY: "19"})
    line_no = next(
        n
        for n, text in enumerate((env_dir / "decode.env").read_text().splitlines(), 1)
        if text.startswith(f"{CPU_ONLY}=")
    )
    done = env_check(env_dir)
    assert done.returncode == 1, done.stdout
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL") and CPU_ONLY in ln]
    assert len(fails) == 1, done.stdout
    assert f"{env_dir / 'decode.env'}:{line_no}: {CPU_ONLY}=19" in fails[0]
    assert "decode engine is not" in fails[0] and "SGLANG_USE_CPU_ENGINE=1" in fails[0]
    up = run_pd("up", "--env-dir", str(env_dir), "--sim")
    assert up.returncode == 2, up.stdout + up.stderr
    assert CPU_ONLY in up.stderr and "up: nothing started" in up.stderr
    assert processes_using(env_dir) == []
    # Patch 0016's SM120 path on CPU likewise (0 leaves it off, so 0 passes).
    set_values(env_dir / "decode.env", **{CPU_ONLY: ""})
    set_values(env_dir / "prefill.env", SGLANG_CPU_SM120_PATH="0")
    assert "SGLANG_CPU_SM120_PATH" not in env_check(env_dir).stdout
    set_values(env_dir / "prefill.env", SGLANG_CPU_SM120_PATH="1")
    done = env_check(env_dir)
    fail = next(ln for ln in done.stdout.splitlines() if "SGLANG_CPU_SM120_PATH" in ln)
    assert "prefill.env" in fail and "prefill engine is not" in fail


def test_cpu_only_settings_pass_where_every_engine_reading_them_is_a_cpu_engine(env_dir):
    # In common.env, read by both engines: refused while decode is not a CPU engine ...
    set_values(env_dir / "common.env", **{CPU_ONLY: "19"})
    set_values(env_dir / "prefill.env", SGLANG_USE_CPU_ENGINE="1")
    done = env_check(env_dir)
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL") and CPU_ONLY in ln]
    assert len(fails) == 1 and "common.env" in fails[0], done.stdout
    assert "decode engine is not" in fails[0]
    # ... and passes once both are (as env/cpu sets them).
    set_values(env_dir / "common.env", SGLANG_USE_CPU_ENGINE="1")
    assert CPU_ONLY not in env_check(env_dir).stdout


def _smg_launch(*flags: str):
    """The installed smg itself on a command line (the reference env check must agree with)."""
    import subprocess

    smg = ROOT / ".venv" / "bin" / "smg"
    return subprocess.run(
        [
            str(smg),
            "launch",
            "--pd-disaggregation",
            "--prefill",
            "http://127.0.0.1:9",
            "--decode",
            "http://127.0.0.1:9",
            "--port",
            "0",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )


def _router_args_line(env_dir) -> int:
    lines = (env_dir / "router.env").read_text().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if ln.startswith("ROUTER_ARGS="))


def test_env_check_names_a_misspelt_router_flag_with_its_file_and_line(env_dir):
    # The typo: smg itself stops on it (so the router would fail at up, after the engines).
    smg = _smg_launch("--worker-overlod-shed")
    assert smg.returncode == 2 and "unrecognized arguments: --worker-overlod-shed" in smg.stderr
    set_values(env_dir / "router.env", ROUTER_ARGS='"--policy round_robin --worker-overlod-shed"')
    done = env_check(env_dir)
    assert done.returncode == 1, done.stdout
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1, done.stdout
    assert f"router.env:{_router_args_line(env_dir)}: ROUTER_ARGS" in fails[0]
    assert "--worker-overlod-shed" in fails[0] and "unrecognized arguments" in fails[0]
    assert "smg's parser" in done.stdout


def _smg_bin_line(env_dir) -> int:
    lines = (env_dir / "router.env").read_text().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if ln.startswith("SMG_BIN="))


def test_env_check_finds_a_bare_smg_bin_on_path_as_router_sh_does(env_dir, tmp_path):
    # launch/router.sh runs a bare SMG_BIN from PATH (`command -v`); env check reads the same
    # smg's parser, so the misspelt flag is refused.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "smg-on-path").symlink_to(ROOT / ".venv" / "bin" / "smg")
    set_values(
        env_dir / "router.env",
        SMG_BIN="smg-on-path",
        ROUTER_ARGS='"--policy round_robin --worker-overlod-shed"',
    )
    path = f"{bin_dir}:{os.environ['PATH']}"
    dry_run = subprocess.run(
        [str(ROOT / "launch" / "router.sh"), "--env-dir", str(env_dir), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PATH": path},
    )
    assert f"{bin_dir}/smg-on-path launch" in dry_run.stdout, dry_run.stdout + dry_run.stderr
    done = run_pd("env", "check", "--env-dir", str(env_dir), env_extra={"PATH": path})
    assert done.returncode == 1, done.stdout
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1 and "--worker-overlod-shed" in fails[0], done.stdout
    assert f"SMG_BIN {bin_dir}/smg-on-path" in done.stdout


def test_env_check_refuses_a_bare_smg_bin_on_no_path_directory(env_dir):
    set_values(env_dir / "router.env", SMG_BIN="smg-on-no-path")
    done = env_check(env_dir)
    assert done.returncode == 1, done.stdout
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL")]
    assert fails == [
        f"FAIL {env_dir}/router.env:{_smg_bin_line(env_dir)}: SMG_BIN=smg-on-no-path: no such "
        "executable on PATH; launch/router.sh could not start the router"
    ], done.stdout
    assert "smg's parser" not in done.stdout


def test_env_check_shows_no_value_given_to_a_secret_router_flag(env_dir):
    planted = [f"planted-{i}-7c1e" for i in range(5)]
    set_values(
        env_dir / "router.env",
        ROUTER_ARGS=f'"--tenant-api-key t:{planted[0]} --oracle-password={planted[1]} '
        f"--control-plane-api-keys {planted[2]} --cache-boundaries {planted[3]} "
        f'--oracle-pasword {planted[4]}"',
    )
    done = env_check(env_dir)
    assert done.returncode == 1, done.stdout
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 2, done.stdout
    assert "--cache-boundaries" in fails[0] and "--oracle-pasword" in fails[1], done.stdout
    assert not [v for v in planted if v in done.stdout + done.stderr], done.stdout
    # Once the line parses, smg's own reading of the values (here a control-plane key that is
    # not id:name:role:key) is refused without the value either.
    set_values(
        env_dir / "router.env",
        ROUTER_ARGS=f'"--tenant-api-key t:{planted[0]} --control-plane-api-keys {planted[2]}"',
    )
    done = env_check(env_dir)
    fail = next(ln for ln in done.stdout.splitlines() if ln.startswith("FAIL"))
    assert "control-plane API key" in fail and planted[2] not in done.stdout, done.stdout


def test_env_check_refuses_a_router_value_outside_smgs_choices(env_dir):
    smg = _smg_launch("--policy", "round_robbin")
    assert smg.returncode == 2 and "invalid choice: 'round_robbin'" in smg.stderr
    set_values(env_dir / "router.env", ROUTER_ARGS='"--policy round_robbin"')
    done = env_check(env_dir)
    fail = next(ln for ln in done.stdout.splitlines() if ln.startswith("FAIL"))
    assert "ROUTER_ARGS: --policy" in fail and "'round_robbin'" in fail


def test_env_check_accepts_the_router_flags_smg_accepts(env_dir):
    flags = "--worker-overload-shed --pd-admission-wait-secs 10 --retry-max-retries 0"
    # smg's own launcher parses them (it stops only later, at the unreachable workers).
    from smg.launch_router import parse_router_args

    parse_router_args(["--pd-disaggregation", *flags.split()])
    set_values(env_dir / "router.env", ROUTER_ARGS=f'"{flags}"')
    done = env_check(env_dir)
    assert done.returncode == 0, done.stdout


def test_env_check_refuses_a_model_path_that_is_a_typo_naming_file_line_and_variable(env_dir):
    # The typo: under build/, a directory of this repository, so not a hub id.
    set_values(env_dir / "common.env", MODEL_PATH="build/tiny-missing")
    done = env_check(env_dir)
    assert done.returncode == 1
    fail = next(ln for ln in done.stdout.splitlines() if "MODEL_PATH=build/tiny-missing" in ln)
    line = next(
        i
        for i, ln in enumerate((env_dir / "common.env").read_text().splitlines(), 1)
        if ln.startswith("MODEL_PATH=")
    )
    assert fail.startswith("FAIL") and f"common.env:{line}: MODEL_PATH" in fail
    assert "no such directory" in fail
    # A bare name, a relative path and an absolute one, all missing here.
    for bad in ("tiny-missing", "./models/x", "/nonexistent/deepseek-ai/DeepSeek-V4-Flash"):
        set_values(env_dir / "common.env", MODEL_PATH=bad)
        assert f"FAIL {env_dir}/common.env:{line}: MODEL_PATH={bad}" in env_check(env_dir).stdout


def test_env_check_accepts_a_hub_id_with_a_note_and_a_model_directory(env_dir, tmp_path):
    set_values(env_dir / "common.env", MODEL_PATH="deepseek-ai/DeepSeek-V4-Pro")
    done = env_check(env_dir)
    assert done.returncode == 0, done.stdout
    note = next(ln for ln in done.stdout.splitlines() if "DeepSeek-V4-Pro" in ln)
    assert note.startswith("note") and "model-hub id" in note and "download" in note
    model = _model(tmp_path, "llama")
    set_values(env_dir / "common.env", MODEL_PATH=str(model))
    assert env_check(env_dir).returncode == 0
    (model / "config.json").unlink()
    done = env_check(env_dir)
    assert done.returncode == 1 and "without config.json" in done.stdout


def test_env_check_leaves_a_model_path_on_another_host_to_that_host(env_dir):
    set_values(env_dir / "common.env", MODEL_PATH="/models/DeepSeek-V4-Flash")
    assert "no such directory" in env_check(env_dir).stdout
    # PD_HOST names this host: the engines' 127.0.0.1 is then another host's address.
    done = run_pd("env", "check", "--env-dir", str(env_dir), env_extra={"PD_HOST": "elsewhere"})
    assert "no such directory" not in done.stdout, done.stdout
    assert "not this host, so it was not checked here" in done.stdout


def test_env_cpu_passes_env_check_before_its_tiny_model_is_made(tmp_path):
    env = tmp_path / "cpu"
    shutil.copytree(ROOT / "env" / "cpu", env)
    set_values(env / "common.env", MODEL_PATH="build/tiny-llama-not-made")
    assert env_check(env).returncode == 1
    # The name tools/make_tiny_model.py links its Llama under, made or not.
    from tools import make_tiny_model

    set_values(env / "common.env", MODEL_PATH=f"build/{make_tiny_model.default_out().name}")
    done = env_check(env)
    assert done.returncode == 0, done.stdout
    if not (ROOT / "build" / "tiny-llama" / "config.json").is_file():
        assert "tools/make_tiny_model.py makes it" in done.stdout


def test_router_env_files_state_the_overload_and_admission_settings_with_a_reason():
    from launch.pdlib import router_args

    for name in ("router.env", "cpu/router.env", "cpu-dsv4/router.env"):
        path = ROOT / "env" / name
        text = path.read_text()
        args = {ln.partition("=")[0]: ln for ln in text.splitlines()}["ROUTER_ARGS"]
        comments = "\n".join(ln for ln in text.splitlines() if ln.startswith("#"))
        for flag in (
            "--worker-overload-waiting-requests",
            "--worker-overload-token-usage",
            "--pd-admission-wait-secs",
            "--retry-max-retries",
            "--worker-overload-shed",
        ):
            assert flag in comments, (name, flag)
        assert "--worker-overload-shed" not in args, name  # off, so no arm wins by refusing load
        # smg's own parser reads the values the comments give.
        python = router_args.smg_python(ROOT / ".venv" / "bin" / "smg")
        settings = router_args.ask_smg(python, "settings", args.split('"')[1].split())
        assert settings["worker_overload_waiting_requests"] == 8
        assert settings["worker_overload_token_usage"] == 0.8
        assert settings["pd_admission_wait_secs"] == 30 and settings["retry_max_retries"] == 5
        assert settings["worker_overload_shed"] is False
