import pytest
from bench_harness import ROOT, copy_env_dir, set_env_values

from bench.lib.arms import apply_overlay
from bench.lib.stack import Stack, stack_from_env_dir
from launch.pdlib.envfiles import EnvDir


def test_env_dir_gives_the_urls_launch_starts_the_roles_on(tmp_path):
    env = copy_env_dir(
        tmp_path / "env", ROUTER_HOST="0.0.0.0", ROUTER_PORT="18000", PREFILL_PORT="18001"
    )
    set_env_values(env / "decode.env", DECODE_HOST="127.0.0.2", DECODE_PORT="18002")
    assert stack_from_env_dir(env) == Stack(
        "http://127.0.0.1:18000",
        "http://127.0.0.1:18001",
        "http://127.0.0.2:18002",
        (("prefill", "http://127.0.0.1:18001"), ("decode", "http://127.0.0.2:18002")),
    )


def _two_by_two(tmp_path):
    """env/ with env/2p2d's instance files, as README's 2P2D example builds it."""
    env = copy_env_dir(tmp_path / "env")
    for path in (ROOT / "env" / "2p2d").glob("*.env"):
        (env / path.name).write_text(path.read_text())
    return env


def test_an_env_dir_with_instance_files_gives_every_instance_by_name(tmp_path):
    stack = stack_from_env_dir(_two_by_two(tmp_path))
    names = [name for name, _ in stack.engines()]
    assert names == ["prefill/1", "prefill/2", "decode/1", "decode/2"]
    urls = [url for _, url in stack.engines()]
    assert len(set(urls)) == 4 and all(u.startswith("http://") for u in urls)
    assert (stack.prefill_url, stack.decode_url) == (urls[0], urls[2])


def test_engine_url_options_replace_that_kind_of_instance_only(tmp_path):
    import argparse

    from bench.lib.stack import add_stack_args, stack_from_args

    parser = argparse.ArgumentParser()
    add_stack_args(parser)
    args = parser.parse_args(
        [
            "--env-dir",
            str(_two_by_two(tmp_path)),
            "--decode-url",
            "http://127.0.0.1:1",
            "--decode-url",
            "http://127.0.0.1:2",
            "--decode-url",
            "http://127.0.0.1:3",
        ]
    )
    stack = stack_from_args(parser, args)
    assert [n for n, _ in stack.engines()] == [
        "prefill/1",
        "prefill/2",
        "decode/1",
        "decode/2",
        "decode/3",
    ]
    assert stack.engines()[-1] == ("decode/3", "http://127.0.0.1:3")


def test_env_dir_without_a_port_names_the_missing_key(tmp_path):
    env = copy_env_dir(tmp_path / "env", ROUTER_PORT="")
    with pytest.raises(ValueError, match="ROUTER_PORT"):
        stack_from_env_dir(env)


def test_overlay_replaces_existing_lines_and_adds_new_keys_to_decode(tmp_path):
    base = copy_env_dir(tmp_path / "env")
    dest = tmp_path / "env-A"
    overlay = tmp_path / "A.env"
    overlay.write_text("# arm\nSGLANG_SM120_MMA_TARGET_CTAS=384\nSGLANG_NEW_KNOB=1\n")
    assert apply_overlay(base, overlay, dest) == {
        "SGLANG_SM120_MMA_TARGET_CTAS": "384",
        "SGLANG_NEW_KNOB": "1",
    }
    decode = EnvDir(dest).values("decode.env")
    assert decode["SGLANG_SM120_MMA_TARGET_CTAS"] == "384"
    assert decode["SGLANG_NEW_KNOB"] == "1"
    assert EnvDir(base).values("decode.env")["SGLANG_SM120_MMA_TARGET_CTAS"] == "auto"
    assert stack_from_env_dir(dest) == stack_from_env_dir(ROOT / "env")


def test_overlay_line_outside_the_env_format_is_reported_with_its_line_number(tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_text("GOOD=1\nexport SGLANG_SM120_MMA_TARGET_CTAS=512\n")
    with pytest.raises(ValueError, match="bad.env:2"):
        apply_overlay(copy_env_dir(tmp_path / "env"), bad, tmp_path / "out")


def test_sim_stack_env_copy_is_in_launch_format_with_loopback_ports(tmp_path):
    from bench.lib.simstack import NEAR_ZERO, prepare_env

    env = prepare_env(ROOT / "env", tmp_path / "env", NEAR_ZERO, api_key="k3y with space")
    stack = stack_from_env_dir(env)
    urls = [stack.router_url, stack.prefill_url, stack.decode_url]
    assert all(u.startswith("http://127.0.0.1:") for u in urls)
    assert len(set(urls)) == 3
    # Every file still parses the way launch reads it, with the values asked for.
    common = EnvDir(env).common()
    assert {k: common[k] for k in NEAR_ZERO} == NEAR_ZERO
    assert common["API_KEY"] == "k3y with space"
    assert common["PD_RUN_DIR"] == str(tmp_path / "run")
    router = EnvDir(env).role_env("router")["ROUTER_ARGS"]
    assert router.startswith("--policy round_robin") and router.endswith(
        "--shutdown-grace-period-secs 1"
    )


def test_tools_read_the_repository_env_dir_when_none_is_given():
    import argparse

    from bench.lib.stack import DEFAULT_ENV_DIR, add_stack_args, stack_from_args

    parser = argparse.ArgumentParser()
    add_stack_args(parser)
    args = parser.parse_args([])
    stack = stack_from_args(parser, args)
    assert args.env_dir == DEFAULT_ENV_DIR
    assert stack == stack_from_env_dir(DEFAULT_ENV_DIR)
    assert stack.router_url and stack.prefill_url and stack.decode_url
