"""The mma backend, run in Triton's interpreter, against upstream's torch reference.

Every comparison goes through upstream's entry point flash_mla_with_kvcache_sm120 with the
backend switched to "mma", and a spy makes sure our kernel really ran (a dispatch that fell
through to the reference would otherwise match it trivially). The launch configuration depends
on the device (tile sizes differ between sm_90 and sm_120), so the comparisons run once per
configuration the launcher can choose on our targets, with that target's virtual device active
(under the interpreter it only tells the launcher what the device is).
"""

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cases import Case, assert_matches_reference, make_inputs, reference_args
from sglang.kernels.ops.attention import flash_mla_sm120 as dispatch
from sglang.kernels.ops.attention import flash_mla_sm120_mma as mma
from sglang.kernels.ops.attention import sm120_mma_fit as fit
from sglang.kernels.ops.attention import sm120_mma_splits as splits
from sglang.kernels.ops.attention.sm120_mma_splits import ENV_NAME

from bench.kernel.lib.virtual_gpu import TARGETS, virtual_device

ROOT = Path(__file__).resolve().parents[2]


def _config_of(target) -> fit.LaunchConfig:
    return fit.config_for(target.arch, fit.limits_for_arch(target.arch).max_shared_per_block)


# One target per distinct launch configuration that the launcher chooses on our targets (today
# one: test_fit.py pins it).
CONFIG_TARGETS = list({_config_of(t): t.key for t in TARGETS.values()}.values())


def _config_id(key: str) -> str:
    cfg = _config_of(TARGETS[key])
    return f"{TARGETS[key].sm}-t{cfg.block_t}-w{cfg.num_warps}-s{cfg.num_stages}"


# H in {16, 64, 128} plus one head count that is not a multiple of the head block; SWA-only and
# SWA+extra with different page sizes; token counts that are not multiples of the tile. Each has
# enough tiles for "4096" to mean several splits at 16- and at 32-token tiles.
CASES = [
    Case(batch=1, heads=16, swa_topk=150),
    Case(batch=3, heads=16, swa_topk=140, swa_page_size=256, sink=False),
    Case(batch=2, heads=64, swa_topk=45, extra_topk=77, extra_page_size=64, empty_row=True),
    Case(
        batch=4,
        heads=64,
        swa_topk=128,
        swa_page_size=256,
        extra_topk=50,
        extra_page_size=32,
        with_lengths=False,
    ),
    Case(batch=2, heads=128, swa_topk=33, extra_topk=90, extra_page_size=128),
    Case(batch=5, heads=16, swa_topk=20, extra_topk=200, empty_row=True, sink=False),
    Case(batch=2, heads=20, swa_topk=64, extra_topk=95, extra_page_size=32),
]


@pytest.fixture(params=CONFIG_TARGETS, ids=_config_id)
def target_config(request):
    """Each launch configuration in turn, through its target's (virtual) device."""
    target = TARGETS[request.param]
    with virtual_device(target):
        yield _config_of(target)


def test_every_target_configuration_is_covered():
    assert {_config_of(t) for t in TARGETS.values()} == {
        _config_of(TARGETS[k]) for k in CONFIG_TARGETS
    }


def test_launcher_uses_the_active_device_configuration(target_config, mma_calls, caplog):
    caplog.set_level(logging.INFO, logger=splits.__name__)
    splits._logged.clear()
    _run(make_inputs(Case(batch=1, heads=16, swa_topk=64)))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(ENV_NAME)]
    assert f"KV tiles of {target_config.block_t} tokens" in line
    assert f"x {target_config.ctas_per_sm} resident CTAs" in line


@pytest.fixture
def mma_calls(monkeypatch):
    monkeypatch.setattr(dispatch, "_sm120_default_backend", "mma")
    calls = []
    real = mma.flash_mla_sparse_decode_mma

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(mma, "flash_mla_sparse_decode_mma", spy)
    return calls


def _run(kwargs):
    return dispatch.flash_mla_with_kvcache_sm120(**kwargs)


def _ctas_logged(caplog) -> list[int]:
    return [
        int(r.getMessage().split("-> ")[1].split(" CTAs")[0])
        for r in caplog.records
        if r.getMessage().startswith(ENV_NAME)
    ]


# One CTA walks every row whole; 7 CTAs cut rows at points that are not row boundaries (a
# share that ends one row, walks whole rows and starts another); 4096 gives every tile its
# own CTA, so every row is merged from one piece per tile.
@pytest.mark.parametrize("target", ["1", "7", "4096"], ids=["one-cta", "cut-rows", "cta-per-tile"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_mma_matches_upstream_reference(
    case, target, target_config, mma_calls, monkeypatch, caplog
):
    monkeypatch.setenv(ENV_NAME, target)
    monkeypatch.setattr(splits, "_logged", set())
    caplog.set_level(logging.INFO, logger=splits.__name__)
    kwargs = make_inputs(case)
    out, lse = _run(kwargs)
    assert mma_calls == [kwargs["q"].shape]
    ref_out, ref_lse = dispatch._sm120_sparse_decode_fwd(*reference_args(kwargs))
    assert_matches_reference(out, lse, ref_out, ref_lse)
    (used,) = _ctas_logged(caplog)
    assert used == min(int(target), _units(case, target_config))


def _units(case, config) -> int:
    """Work units of a case: rows (requests x head blocks) x KV tiles per request."""
    tiles = -(-case.swa_topk // config.block_t) + -(-case.extra_topk // config.block_t)
    return case.batch * -(-case.heads // config.block_h) * tiles


def test_empty_row_gives_zero_output_and_minus_inf_lse(mma_calls):
    kwargs = make_inputs(Case(batch=3, heads=16, swa_topk=40, extra_topk=40, empty_row=True))
    out, lse = _run(kwargs)
    assert torch.all(out[-1] == 0)
    assert torch.all(lse[-1] == float("-inf"))
    assert torch.all(out[:-1].abs().amax(dim=-1) > 0)
    assert torch.all(lse[:-1].isfinite())


def test_sink_only_rescales_output_and_leaves_lse(mma_calls):
    case = Case(batch=2, heads=16, swa_topk=50, extra_topk=40, sink=False)
    plain = make_inputs(case)
    sunk = dict(plain, attn_sink=torch.full((16,), 2.0))
    out0, lse0 = _run(plain)
    out1, lse1 = _run(sunk)
    torch.testing.assert_close(lse1, lse0)
    # out_sink = out * exp(lse) / (exp(lse) + exp(sink)), per head.
    factor = torch.sigmoid(lse0 - 2.0).reshape(2, 1, 16, 1)
    torch.testing.assert_close(out1.float(), out0.float() * factor, rtol=1e-2, atol=1e-2)


def test_narrower_value_head_dim_matches_reference(mma_calls):
    kwargs = dict(make_inputs(Case(batch=2, heads=16, swa_topk=40, extra_topk=20)), head_dim_v=448)
    out, lse = _run(kwargs)
    assert out.shape == (2, 1, 16, 448)
    assert_matches_reference(out, lse, *dispatch._sm120_sparse_decode_fwd(*reference_args(kwargs)))


@pytest.mark.parametrize("key", CONFIG_TARGETS, ids=_config_id)
def test_one_cta_and_many_ctas_agree(key, monkeypatch, caplog):
    # Few SMs, so that the automatic choice lands strictly between one split and the most.
    small = dataclasses.replace(TARGETS[key], sms=8)
    stack = contextlib.ExitStack()
    stack.enter_context(virtual_device(small))
    monkeypatch.setattr(splits, "_logged", set())
    caplog.set_level(logging.INFO, logger=splits.__name__)
    args = reference_args(
        make_inputs(Case(batch=2, heads=32, swa_topk=128, extra_topk=300, empty_row=True))
    )
    results = {}
    with stack:
        for target in ("1", "auto", "100000"):
            monkeypatch.setenv(ENV_NAME, target)
            results[target] = mma.flash_mla_sparse_decode_mma(*args)
    one, auto, many = _ctas_logged(caplog)
    assert one == 1 and many > auto > 1, (one, auto, many)
    ref_out, ref_lse = results["1"]
    for target in ("auto", "100000"):
        out, lse = results[target]
        # Different cut points only reorder fp32 sums; bf16 output may differ by one rounding.
        scale = ref_out.float().abs().amax()
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-7, atol=1e-3 * scale)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-5)


def test_malformed_knob_fails_on_first_use(mma_calls, monkeypatch):
    monkeypatch.setenv(ENV_NAME, "5.5")
    with pytest.raises(ValueError, match=ENV_NAME):
        _run(make_inputs(Case(batch=1, heads=16, swa_topk=32)))


def test_scratch_is_reused_for_a_shape_and_outputs_are_fresh(monkeypatch):
    monkeypatch.setenv(ENV_NAME, "100000")
    monkeypatch.setattr(mma, "_scratch", {})
    first = reference_args(make_inputs(Case(batch=2, heads=16, swa_topk=160, seed=1)))
    second = reference_args(make_inputs(Case(batch=2, heads=16, swa_topk=160, seed=2)))
    out1, _ = mma.flash_mla_sparse_decode_mma(*first)
    kept = out1.clone()
    out2, _ = mma.flash_mla_sparse_decode_mma(*second)
    (buffers,) = mma._scratch.values()
    assert len(buffers) == 1
    assert torch.equal(out1, kept) and not torch.equal(out1, out2)


def test_every_row_ticket_is_back_at_zero_after_a_call(monkeypatch):
    # Rows cut between CTAs count their pieces in a buffer that is zeroed once, at allocation;
    # the CTA that merges a row sets its ticket back to 0. A second call with new inputs must
    # therefore merge every row again.
    monkeypatch.setenv(ENV_NAME, "7")
    monkeypatch.setattr(mma, "_counters", {})
    for seed in (1, 2):
        kwargs = make_inputs(Case(batch=3, heads=32, swa_topk=90, extra_topk=70, seed=seed))
        out, lse = mma.flash_mla_sparse_decode_mma(*reference_args(kwargs))
        assert_matches_reference(
            out, lse, *dispatch._sm120_sparse_decode_fwd(*reference_args(kwargs))
        )
        ((counters,),) = mma._counters.values()
        assert counters.numel() >= 3 * 2 and not counters.any()


def test_rejects_multi_token_queries():
    q = torch.zeros(1, 2, 16, 512, dtype=torch.bfloat16)
    args = list(reference_args(make_inputs(Case(batch=1, heads=16, swa_topk=32))))
    args[0] = q
    with pytest.raises(ValueError, match=r"\[B, 1, H, D\]"):
        mma.flash_mla_sparse_decode_mma(*args)


_ENV_SELECTED = """
import sys
from cases import Case, assert_matches_reference, make_inputs, reference_args
from sglang.kernels.ops.attention import flash_mla_sm120 as d
kwargs = make_inputs(Case(batch=2, heads=16, swa_topk=40, extra_topk=30))
out, lse = d.flash_mla_with_kvcache_sm120(**kwargs)
assert "sglang.kernels.ops.attention.flash_mla_sm120_mma" in sys.modules
assert_matches_reference(out, lse, *d._sm120_sparse_decode_fwd(*reference_args(kwargs)))
print("selected", d._sm120_default_backend)
"""


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, TRITON_INTERPRET="1", SGLANG_SM120_FLASHMLA_BACKEND="mma", **env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=240
    )


def test_backend_env_selects_mma_at_import():
    done = _python(_ENV_SELECTED, **{ENV_NAME: "512"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "selected mma" in done.stdout


def test_malformed_knob_fails_at_startup():
    done = _python("import sglang.kernels.ops.attention.flash_mla_sm120", **{ENV_NAME: "abc"})
    assert done.returncode != 0
    assert f"{ENV_NAME}='abc' is invalid" in done.stderr
