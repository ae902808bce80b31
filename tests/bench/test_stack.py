import pytest

from bench.lib.arms import apply_overlay
from bench.lib.stack import Stack, read_env_file, stack_from_env_dir


def _env_dir(tmp_path):
    d = tmp_path / "env"
    d.mkdir()
    (d / "common.env").write_text("# hosts\nHOST=0.0.0.0\n")
    (d / "prefill.env").write_text("PREFILL_PORT=30000\nPREFILL_BOOTSTRAP_PORT=8998\n")
    (d / "decode.env").write_text('DECODE_PORT=30001\nexport SGLANG_SM120_MMA_TARGET_CTAS="256"\n')
    (d / "router.env").write_text("ROUTER_PORT=8000\n")
    return d


def test_env_dir_gives_router_and_engine_urls(tmp_path):
    assert stack_from_env_dir(_env_dir(tmp_path)) == Stack(
        "http://127.0.0.1:8000", "http://127.0.0.1:30000", "http://127.0.0.1:30001"
    )


def test_env_dir_without_a_port_names_the_missing_role(tmp_path):
    d = _env_dir(tmp_path)
    (d / "router.env").write_text("ROUTER_POLICY=round_robin\n")
    with pytest.raises(ValueError, match="ROUTER..._PORT"):
        stack_from_env_dir(d)


def test_overlay_replaces_existing_lines_and_adds_new_keys_to_decode(tmp_path):
    base = _env_dir(tmp_path)
    overlay = tmp_path / "B.env"
    overlay.write_text("SGLANG_SM120_MMA_TARGET_CTAS=512\nSGLANG_NEW_KNOB=1\n")
    dest = tmp_path / "env-B"
    assert apply_overlay(base, overlay, dest) == {
        "SGLANG_SM120_MMA_TARGET_CTAS": "512",
        "SGLANG_NEW_KNOB": "1",
    }
    decode = read_env_file(dest / "decode.env")
    assert decode["SGLANG_SM120_MMA_TARGET_CTAS"] == "512"
    assert decode["SGLANG_NEW_KNOB"] == "1"
    assert read_env_file(base / "decode.env")["SGLANG_SM120_MMA_TARGET_CTAS"] == "256"


def test_malformed_env_line_is_reported_with_its_line_number(tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_text("GOOD=1\nnot a setting\n")
    with pytest.raises(ValueError, match="bad.env:2"):
        read_env_file(bad)
