"""SGLANG_SM120_MMA_TARGET_CTAS: strict parsing and the split choice (pure Python)."""

import logging

import pytest
from sglang.kernels.ops.attention import sm120_mma_splits as splits
from sglang.kernels.ops.attention.sm120_mma_splits import (
    ENV_NAME,
    parse_target_ctas,
    resolve_split_count,
    split_count_for,
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
    shape = dict(batch=16, head_blocks=1, num_tiles=64, tile_tokens=32, num_sms=132, ctas_per_sm=2)
    shape.update(over)
    return shape


@pytest.mark.parametrize(
    "target, batch, head_blocks, expected",
    [
        (512, 64, 1, 8),  # 64 x 1 x 8 = 512
        (512, 16, 2, 16),  # 16 x 2 x 16 = 512
        (256, 32, 4, 2),  # 32 x 4 x 2 = 256
        (512, 128, 4, 1),  # already 512 CTAs without splitting
        (100, 64, 1, 2),  # nearest: 64 x 2 = 128 is closer to 100 than 64
        (1, 64, 1, 1),  # never fewer than one split
    ],
)
def test_fixed_target_makes_ctas_about_n(target, batch, head_blocks, expected):
    got = split_count_for(target, **_shape(batch=batch, head_blocks=head_blocks))
    assert got == expected


def test_fixed_target_is_capped_at_one_split_per_tile():
    assert split_count_for(4096, **_shape(batch=1)) == 64
    assert split_count_for(4096, **_shape(batch=1, num_tiles=1)) == 1


def test_no_split_is_left_without_tiles():
    for num_tiles in range(1, 70):
        for target in (None, 7, 64, 512, 10_000):
            for batch in (1, 3, 64):
                n = split_count_for(target, **_shape(batch=batch, num_tiles=num_tiles))
                per_split = -(-num_tiles // n)
                assert 1 <= n <= num_tiles
                assert (n - 1) * per_split < num_tiles, (num_tiles, target, batch, n)


def test_auto_splits_small_batches_and_not_large_ones():
    small = split_count_for(None, **_shape(batch=1))
    large = split_count_for(None, **_shape(batch=512))
    assert small > 4
    assert large == 1
    counts = [split_count_for(None, **_shape(batch=b)) for b in (1, 16, 64, 128, 256)]
    assert counts == sorted(counts, reverse=True)


# The targets' SM counts (datasheet) and the compiled stage 1's resident CTAs per SM there.
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
    return split_count_for(None, **shape)


@pytest.mark.parametrize("key", TARGET_SLOTS)
def test_auto_gives_a_single_request_a_wave_or_at_most_two_tiles_per_cta(key):
    sms, per_sm = TARGET_SLOTS[key]
    for num_tiles in (*TILE_COUNTS, 1, 7, 200, 1000):
        for head_blocks in (1, 2, 4, 8):
            n = _auto_on(key, 1, head_blocks, num_tiles)
            ctas, per_cta = head_blocks * n, -(-num_tiles // n)
            assert ctas <= sms * per_sm or n == 1, (num_tiles, head_blocks, n)
            # One or two tiles per CTA, or as few as one wave allows: walking one tile fewer
            # would need more CTAs than a wave holds.
            fewer = per_cta - 1
            assert per_cta <= 2 or head_blocks * -(-num_tiles // fewer) > sms * per_sm, (
                num_tiles,
                head_blocks,
                n,
            )


@pytest.mark.parametrize("key", TARGET_SLOTS)
def test_auto_gives_one_split_once_the_batch_fills_the_gpu(key):
    sms, per_sm = TARGET_SLOTS[key]
    for head_blocks in (1, 2, 4, 8):
        full = -(-sms * per_sm // head_blocks)
        for batch in (full, full + 1, 2 * full, 4 * full):
            for num_tiles in (*TILE_COUNTS, 1, 1000):
                n = _auto_on(key, batch, head_blocks, num_tiles)
                assert n == 1, (batch, head_blocks, num_tiles, n)


@pytest.mark.parametrize("key", TARGET_SLOTS)
def test_auto_never_launches_an_empty_cta_or_more_than_three_waves_of_splits(key):
    sms, per_sm = TARGET_SLOTS[key]
    slots = sms * per_sm
    for batch in (1, 2, 3, 8, 16, 31, 64, 96, 128, 200):
        for head_blocks in (1, 2, 4, 8):
            for num_tiles in range(1, 80):
                n = _auto_on(key, batch, head_blocks, num_tiles)
                per_split = -(-num_tiles // n)
                assert (n - 1) * per_split < num_tiles
                assert n == 1 or -(-batch * head_blocks * n // slots) <= 3


def test_auto_uses_more_sms_for_more_splits():
    few = split_count_for(None, **_shape(batch=32, num_sms=16))
    many = split_count_for(None, **_shape(batch=32, num_sms=188))
    assert many > few


def test_auto_never_fills_one_wave_just_past_full():
    # Wave quantization: at 132 SMs x 2 slots, 4 splits of 64 requests is 256 CTAs (one wave);
    # 5 splits would need a second, nearly empty wave.
    got = split_count_for(None, **_shape(batch=64, num_sms=132))
    assert 64 * got <= 132 * 2


def test_auto_counts_resident_ctas_per_sm():
    # The same device holding one CTA per SM instead of two has half the slots per wave.
    one = split_count_for(None, **_shape(batch=64, num_sms=132, ctas_per_sm=1))
    two = split_count_for(None, **_shape(batch=64, num_sms=132, ctas_per_sm=2))
    assert 64 * one <= 132 < 64 * two <= 2 * 132


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="positive shapes"):
        split_count_for(None, **_shape(batch=0))
    with pytest.raises(ValueError, match="ctas_per_sm=0"):
        split_count_for(None, **_shape(ctas_per_sm=0))


def test_choice_is_logged_once_per_knob_and_shape(monkeypatch, caplog):
    monkeypatch.setattr(splits, "_logged", set())
    monkeypatch.setenv(ENV_NAME, "512")
    caplog.set_level(logging.INFO, logger=splits.__name__)
    for _ in range(3):
        assert resolve_split_count(**_shape(batch=64)) == 8
    assert resolve_split_count(**_shape(batch=32)) == 16
    lines = [r.getMessage() for r in caplog.records if ENV_NAME in r.getMessage()]
    assert len(lines) == 2
    assert "batch 64" in lines[0] and "-> 8 splits, 512 CTAs" in lines[0]
    assert "batch 32" in lines[1] and "-> 16 splits" in lines[1]
    monkeypatch.setenv(ENV_NAME, "auto")
    resolve_split_count(**_shape(batch=64))
    lines = [r.getMessage() for r in caplog.records if ENV_NAME in r.getMessage()]
    assert len(lines) == 3 and f"{ENV_NAME}=auto" in lines[2]


def test_splits_round_to_equal_tile_counts():
    # 16 splits of 40 tiles would be 3 tiles each, which 14 splits already cover.
    assert split_count_for(512, **_shape(batch=32, num_tiles=40)) == 14


def test_knob_is_registered_in_sglang_env_registry(monkeypatch):
    from sglang.srt.environ import envs

    monkeypatch.delenv(ENV_NAME, raising=False)
    assert envs.SGLANG_SM120_MMA_TARGET_CTAS.get() == "auto"
    with envs.SGLANG_SM120_MMA_TARGET_CTAS.override("384"):
        assert splits.target_ctas_from_env() == 384
    assert splits.target_ctas_from_env() is None
