"""bench/ab writes no secret: every secret-bearing flag of smg's parser, planted in both arms'
ROUTER_ARGS with a value of its own, is absent from everything bench/ab writes (summary.json,
report.md, comparison.json, requests.jsonl) and from what it prints, the refusal of arms whose
routers differ included. launch/pd is stood in for (nothing starts): the arms' stacks are a
stand-in server at the router's port, and the routers' settings are read with smg's parser from
launch/router.sh's command line, as bench/ab reads them."""

from __future__ import annotations

import argparse
import json
import subprocess

from bench_harness import ROOT, TINY_AB_LOAD, copy_env_dir, free_port

from bench.lib import ab
from bench.lib import arms as arms_mod
from launch.pdlib import router_args

SMG = ROOT / ".venv" / "bin" / "smg"
KNOWN = {"api_key", "tenant_api_key", "control_plane_api_keys", "oracle_password"}
API_KEY = "sk-planted-api-key-0c4e"


def secret_flags() -> dict[str, list[str]]:
    """{dest: option strings} of the flags the rule finds in the installed smg's parser."""
    return router_args.ask_smg(router_args.smg_python(SMG), "secret-flags", [])["secret"]


def _planted_args(tag: str) -> tuple[str, list[str]]:
    """ROUTER_ARGS giving every secret-bearing flag a distinct value smg's parser accepts (half
    as `--flag value`, half as `--flag=value`), and the values."""
    parser, _ = router_args._parser()
    actions = {a.dest: a for a in parser._actions}
    words, values = [], []
    for i, (dest, options) in enumerate(sorted(secret_flags().items())):
        value = f"planted-{tag}-{i:02d}-{dest.replace('_', '-')}"
        convert = actions[dest].type
        if convert is not None:
            try:
                convert(value)
            except ValueError:
                value = f"91{sum(map(ord, tag)):04d}{i:02d}7"  # a converter of numbers
        flag = options[-1] if options[-1].startswith("--") else options[0]
        words += [f"{flag}={value}"] if i % 2 else [flag, value]
        values.append(value)
    return " ".join(["--policy", "round_robin", *words]), values


def _overlay(path, knob: str, args: str):
    path.write_text(f'SGLANG_SM120_MMA_TARGET_CTAS={knob}\nROUTER_ARGS="{args}"\n')
    return path


def _pd_stand_in(co_restart_rc: int, args_a: str):
    """EnvArm._pd without launch/pd: co-restart answers rc (its output echoing A's router line,
    as a router's log tail might), verify names the knob and echoes the line too."""

    def _pd(self, verb: str) -> subprocess.CompletedProcess:
        if verb == "co-restart":
            return subprocess.CompletedProcess(
                [], co_restart_rc, f"router: smg launch {args_a}\n", ""
            )
        line = f"decode SGLANG_SM120_MMA_TARGET_CTAS live; router ROUTER_ARGS={args_a}\n"
        return subprocess.CompletedProcess([], 0, line, "")

    return _pd


def _run(tmp_path, monkeypatch, capsys, engine: str, args_a: str, args_b: str, rc: int = 0):
    port = engine.rsplit(":", 1)[1]
    env = copy_env_dir(
        tmp_path / "env",
        ROUTER_HOST="127.0.0.1",
        ROUTER_PORT=port,
        ROUTER_PROMETHEUS_PORT=str(free_port()),
        PD_RUN_DIR=str(tmp_path / "run"),
        API_KEY=API_KEY,
    )
    monkeypatch.setattr(arms_mod.EnvArm, "_pd", _pd_stand_in(rc, args_a))
    out = tmp_path / "ab"
    code = ab.main(
        [
            "--a",
            str(_overlay(tmp_path / "A.env", "auto", args_a)),
            "--b",
            str(_overlay(tmp_path / "B.env", "512", args_b)),
            "--env-dir",
            str(env),
            "--sim",
            "--concurrency",
            "1",
            "--trials",
            "1",
            *TINY_AB_LOAD,
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr()
    return code, out, printed.out + printed.err


def _written(out) -> dict[str, str]:
    """Every file bench/ab wrote under out, but the arms' env dirs: those are the env the
    stacks run from (a copy of the base env with the overlay, secrets as they are in env/),
    readable by their owner only."""
    for arm in ("env-A", "env-B"):
        if (out / arm).exists():
            assert (out / arm).stat().st_mode & 0o777 == 0o700, arm
    return {
        str(p.relative_to(out)): p.read_text(errors="replace")
        for p in out.rglob("*")
        if p.is_file() and p.relative_to(out).parts[0] not in ("env-A", "env-B")
    }


def _assert_absent(values: list[str], texts: dict[str, str]) -> None:
    for name, text in texts.items():
        leaked = [v for v in values if v in text]
        assert not leaked, (name, leaked)


def test_the_rule_finds_the_known_secret_flags_in_smgs_parser():
    found = secret_flags()
    assert KNOWN <= set(found), sorted(found)
    # Flags whose value cannot hold a secret are let off, whatever their help says.
    assert "worker_overload_token_usage" not in found  # a number
    assert "tokenizer_path" not in found and "policy" not in found


def test_the_rule_fails_closed_on_a_flag_smg_might_add():
    for flag, help_text in (
        ("--vault-credential", "where the router logs in"),
        ("--upstream-auth", "a bearer token sent to the workers"),
        ("--store-dsn", None),
        ("--hub-apikey", None),
    ):
        parser = argparse.ArgumentParser()
        action = parser.add_argument(flag, help=help_text)
        assert router_args.secret_bearing(action), flag
    parser = argparse.ArgumentParser()
    assert not router_args.secret_bearing(parser.add_argument("--max-tokens", type=int))
    assert not router_args.secret_bearing(parser.add_argument("--key-cache", action="store_true"))


def test_a_url_with_a_password_is_fingerprinted_whatever_its_flag():
    python = router_args.smg_python(SMG)
    argv = ["--prefill", "http://user:planted-pw-1@127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
    settings = router_args.ask_smg(python, "settings", argv)
    assert "planted-pw-1" not in json.dumps(settings)
    assert settings["prefill"].startswith("<redacted ") and settings["decode"][0][0].endswith(":9")
    refused = router_args.ask_smg(python, "refusals", [*argv, "--polcy", "x"])
    assert refused and "planted-pw-1" not in json.dumps(refused)


def test_secret_flags_reach_no_file_bench_ab_writes(tmp_path, monkeypatch, capsys, fake_engine):
    args, values = _planted_args("same")
    code, out, printed = _run(tmp_path, monkeypatch, capsys, fake_engine(), args, args)
    assert code == 0, printed
    summary = json.loads((out / "summary.json").read_text())
    planned = summary["router_settings_planned"]["settings"]
    # Recorded, as fingerprints: the same in both arms, so the arms were compared by them.
    for dest in sorted(set(secret_flags()) - {"api_key"}):
        assert planned[dest].startswith("<redacted "), (dest, planned[dest])
    assert summary["router_settings"]["A"]["1"]["settings"] == planned
    # The rest stays readable: a word after a flag that only begins like a secret one
    # (--prefill, --prefill-selector) is not taken for a secret.
    assert planned["policy"] == "round_robin" and planned["prefill"][0][0].startswith("http://")
    assert {"summary.json", "report.md", "comparison.json", "requests.jsonl"} <= set(_written(out))
    _assert_absent([*values, API_KEY], {**_written(out), "printed": printed})


def test_the_refusal_of_routers_that_differ_names_each_flag_and_no_value(
    tmp_path, monkeypatch, capsys, fake_engine
):
    args_a, values_a = _planted_args("armA")
    args_b, values_b = _planted_args("armB")
    code, out, printed = _run(tmp_path, monkeypatch, capsys, fake_engine(), args_a, args_b)
    assert code == 1 and "different routing settings" in printed, printed
    for dest in sorted(set(secret_flags()) - {"api_key"}):
        assert f"--{dest.replace('_', '-')}: A '<redacted " in printed, dest
    assert not (out / "summary.json").exists()
    _assert_absent([*values_a, *values_b, API_KEY], {**_written(out), "printed": printed})


def test_a_failed_co_restart_prints_no_secret(tmp_path, monkeypatch, capsys, fake_engine):
    args, values = _planted_args("same")
    code, out, printed = _run(tmp_path, monkeypatch, capsys, fake_engine(), args, args, rc=1)
    assert code == 1 and "co-restart failed" in printed and "<redacted>" in printed, printed
    _assert_absent([*values, API_KEY], {**_written(out), "printed": printed})
