"""SGLANG_SM120_MMA_TARGET_CTAS: strict parsing and the CTA count (pure Python)."""

import logging

import pytest
from sglang.kernels.ops.attention import sm120_mma_splits as splits
from sglang.kernels.ops.attention.sm120_mma_splits import (
    ENV_NAME,
    cta_count_for,
    parse_target_ctas,
    resolve_cta_count,
)


@pytest.mark.parametrize("raw", [None, "auto", "AUTO", " auto "])
def test_unset_or_auto_selects_the_automatic_choice(raw):
    assert parse_target_ctas(raw) is None


@pytest.mark.parametrize("raw, value", [("512", 512), ("1", 1), (" 256 ", 256)])
def test_positive_integer_is_the_target(raw, value):
    assert parse_target_ctas(raw) == value


@pytest.mark.parametrize("raw", ["-1", "0", "abc", "5.5", "", "+512", "1e3", "0x200", "512 ctas"])
def test_malformed_knob_is_an_error_naming_variable_and_forms(raw):
    with pytest.raises(ValueError) as err:
        parse_target_ctas(raw)
    message = str(err.value)
    assert ENV_NAME in message and repr(raw) in message
    assert "'auto'" in message and "positive integer" in message


def test_knob_error_surfaces_when_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_NAME, "-4")
    with pytest.raises(ValueError, match=ENV_NAME):
        splits.target_ctas_from_env()
    monkeypatch.setenv(ENV_NAME, "64")
    assert splits.target_ctas_from_env() == 64
    monkeypatch.delenv(ENV_NAME)
    assert splits.target_ctas_from_env() is None


def _shape(**over):
    shape = dict(batch=16, head_blocks=1, num_tiles=64, num_sms=132, ctas_per_sm=2)
    shape.update(over)
    return shape


def test_fixed_target_is_the_cta_count():
    assert cta_count_for(512, **_shape(batch=64)) == 512
    assert cta_count_for(7, **_shape(batch=3, head_blocks=2)) == 7


def test_fixed_target_is_capped_at_one_cta_per_tile():
    assert cta_count_for(4096, **_shape(batch=1)) == 64
    assert cta_count_for(4096, **_shape(batch=2, head_blocks=3, num_tiles=1)) == 6


# The targets' SM counts (datasheet) and the compiled stage 1's resident CTAs per SM there
# (bench/kernel/audit prints them; test_kernel_audit.py checks the compiled figure).
TARGET_SLOTS = {
    "rtx-pro-6000": (188, 1),
    "rtx-5090": (170, 1),
    "dgx-spark": (48, 1),
    "h200": (132, 1),
}
# DSV4 decode tile counts at 32-row tiles: SWA 128 alone, + c4 512, + c4 2048, + c128 512.
TILE_COUNTS = (4, 20, 68, 20)


def _auto_on(key: str, batch: int, head_blocks: int, num_tiles: int) -> int:
    sms, per_sm = TARGET_SLOTS[key]
    shape = _shape(
        batch=batch, head_blocks=head_blocks, num_tiles=num_tiles, num_sms=sms, ctas_per_sm=per_sm
    )
    return cta_count_for(None, **shape)


def _shares(units: int, ctas: int) -> list[int]:
    """Units per CTA under the kernel's rule: CTA c walks [c W / C, (c + 1) W / C)."""
    return [(c + 1) * units // ctas - c * units // ctas for c in range(ctas)]


@pytest.mark.parametrize("key", TARGET_SLOTS)
def test_auto_fills_every_slot_of_its_wave_from_b16_to_b128(key):
    # The bar: at least 90% of the last wave's slots busy, and every CTA's share within
    # one tile of every other's. Where a call has fewer tiles than the device has slots, no
    # grid can fill it; there the count stays at most one CTA per tile.
    sms, per_sm = TARGET_SLOTS[key]
    slots = sms * per_sm
    for batch in range(16, 129):
        for head_blocks in (1, 2, 4, 8):
            for num_tiles in TILE_COUNTS:
                units = batch * head_blocks * num_tiles
                n = _auto_on(key, batch, head_blocks, num_tiles)
                shares = _shares(units, n)
                assert min(shares) >= 1 and max(shares) - min(shares) <= 1
                if units >= slots:
                    waves = -(-n // slots)
                    assert n >= 0.9 * waves * slots, (batch, head_blocks, num_tiles, n)
                else:
                    assert n <= units


@pytest.mark.parametrize("key", TARGET_SLOTS)
def test_auto_never_launches_an_empty_cta(key):
    for batch in (1, 2, 3, 8, 16, 31, 64, 96, 128, 200):
        for head_blocks in (1, 2, 4, 8):
            for num_tiles in (1, 2, 3, 4, 7, 20, 68, 79):
                n = _auto_on(key, batch, head_blocks, num_tiles)
                assert 1 <= n <= batch * head_blocks * num_tiles
                assert min(_shares(batch * head_blocks * num_tiles, n)) >= 1


def test_auto_weighs_walking_tiles_against_merging_pieces_for_one_request():
    # One request of 20 tiles on 188 slots: a CTA per tile would leave one CTA merging 20
    # pieces; the model gives each CTA a few tiles and the merge a few pieces.
    n = cta_count_for(None, **_shape(batch=1, num_tiles=20, num_sms=188, ctas_per_sm=1))
    assert 1 < n < 20
    assert splits.pieces_per_row(1, 20, n) == n
    assert splits.modelled_cost(1, 20, n) < splits.modelled_cost(1, 20, 20)
    assert splits.modelled_cost(1, 20, n) < splits.modelled_cost(1, 20, 1)


def test_pieces_follow_the_kernels_share_rule():
    # 3 rows of 5 tiles over 4 CTAs: shares [0,3) [3,7) [7,11) [11,15); row 1 = units 5-9 is
    # cut between CTAs 1 and 2, row 0 between 0 and 1, row 2 between 2 and 3.
    assert [splits.cta_of(u, 4, 15) for u in range(15)] == [0] * 3 + [1] * 4 + [2] * 4 + [3] * 4
    assert splits.pieces_per_row(3, 5, 4) == 2
    assert splits.pieces_per_row(3, 5, 3) == 1
    assert splits.pieces_per_row(1, 20, 20) == 20


def test_auto_counts_resident_ctas_per_sm():
    # The same device holding one CTA per SM instead of two has half the slots per wave.
    one = cta_count_for(None, **_shape(batch=64, num_sms=132, ctas_per_sm=1))
    two = cta_count_for(None, **_shape(batch=64, num_sms=132, ctas_per_sm=2))
    assert (one, two) == (132, 264)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="positive shapes"):
        cta_count_for(None, **_shape(batch=0))
    with pytest.raises(ValueError, match="ctas_per_sm=0"):
        cta_count_for(None, **_shape(ctas_per_sm=0))


def test_choice_is_logged_once_per_knob_and_shape(monkeypatch, caplog):
    monkeypatch.setattr(splits, "_logged", set())
    monkeypatch.setenv(ENV_NAME, "512")
    caplog.set_level(logging.INFO, logger=splits.__name__)
    for _ in range(3):
        assert resolve_cta_count(tile_tokens=32, **_shape(batch=64)) == 512
    assert resolve_cta_count(tile_tokens=32, **_shape(batch=4)) == 256
    lines = [r.getMessage() for r in caplog.records if ENV_NAME in r.getMessage()]
    assert len(lines) == 2
    assert "batch 64" in lines[0] and "-> 512 CTAs, 8.0 tiles each" in lines[0]
    assert "batch 4" in lines[1] and "-> 256 CTAs, 1.0 tiles each" in lines[1]
    monkeypatch.setenv(ENV_NAME, "auto")
    resolve_cta_count(tile_tokens=32, **_shape(batch=64))
    lines = [r.getMessage() for r in caplog.records if ENV_NAME in r.getMessage()]
    assert len(lines) == 3 and f"{ENV_NAME}=auto" in lines[2]
    assert "-> 264 CTAs" in lines[2] and "100% of the wave's slots" in lines[2]


def test_knob_is_registered_in_sglang_env_registry(monkeypatch):
    from sglang.srt.environ import envs

    monkeypatch.delenv(ENV_NAME, raising=False)
    assert envs.SGLANG_SM120_MMA_TARGET_CTAS.get() == "auto"
    with envs.SGLANG_SM120_MMA_TARGET_CTAS.override("384"):
        assert splits.target_ctas_from_env() == 384
    assert splits.target_ctas_from_env() is None
