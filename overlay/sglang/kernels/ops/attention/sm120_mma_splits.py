"""How many KV splits the SM120 MMA sparse-decode kernel launches: the
``SGLANG_SM120_MMA_TARGET_CTAS`` knob and the automatic choice.

The stage-1 grid is ``batch x head_blocks x splits`` programs (CTAs). Few CTAs leave SMs idle;
many splits multiply the fp32 partial outputs that stage 2 has to read back. The knob says how
many CTAs to aim for; ``auto`` (the default) picks the split count from a wave-quantization cost
model in the spirit of FlashAttention's ``num_splits_heuristic``.

Standard library only, so the parser and the split choice can be checked without torch or a GPU.
The variable is read from ``os.environ`` directly: it is registered in sglang's env registry as
a plain string (so ``envs.SGLANG_SM120_MMA_TARGET_CTAS.override(...)`` works), but the registry's
``get()`` turns a malformed value into a warning plus the default, and a mistyped knob must fail.
"""

import logging
import math
import os
import re
from functools import lru_cache

logger = logging.getLogger(__name__)

ENV_NAME = "SGLANG_SM120_MMA_TARGET_CTAS"
AUTO = "auto"

# Splits never get shorter than this many KV tokens: below it the per-split fixed cost
# (query load, partial write, combine read) dominates the KV it reads.
MIN_TOKENS_PER_SPLIT = 64

# Cost model of the automatic choice, in units of "one CTA gathers one KV token" (the tile size
# differs per device, so costs are counted in tokens). Calibrate these with
# bench/kernel/microbench against fixed TARGET_CTAS values on the target GPU. The resident CTAs
# per SM are not a constant here: the launcher reads them from the compiled kernel on the device
# (registers, shared memory, warps; see sm120_mma_fit.occupancy).
# Per-CTA cost besides its tokens: launch ramp and the query block load.
CTA_OVERHEAD_TOKENS = 32
# Extra per-CTA cost once there is more than one split: a 16-head x 512 fp32 partial is
# about 32 KiB written by stage 1 and read again by stage 2, against 584 bytes per KV token.
SPLIT_OVERHEAD_TOKENS = 112
# Launching the combine kernel at all, in wave-token units (a few microseconds).
COMBINE_LAUNCH_TOKENS = 96

_POSITIVE_INT = re.compile(r"[0-9]+")


def _knob_error(raw: str, why: str) -> ValueError:
    return ValueError(
        f"{ENV_NAME}={raw!r} is invalid ({why}); accepted: unset or {AUTO!r} for the automatic "
        f"choice, or a positive integer N (aim for about N CTAs: batch x head blocks x splits)"
    )


def parse_target_ctas(raw: str | None) -> int | None:
    """Parse the knob's text: None (unset) or ``auto`` -> None (automatic); ``N`` -> N > 0.

    Anything else raises ValueError naming the variable and the accepted forms.
    """
    if raw is None:
        return None
    text = raw.strip()
    if text.lower() == AUTO:
        return None
    if not _POSITIVE_INT.fullmatch(text):
        raise _knob_error(raw, "not an integer" if text else "empty")
    value = int(text)
    if value <= 0:
        raise _knob_error(raw, "must be greater than 0")
    return value


@lru_cache(maxsize=16)
def _parse_cached(raw: str | None) -> int | None:
    return parse_target_ctas(raw)


def target_ctas_from_env() -> int | None:
    """The knob's current value (None = auto); raises ValueError if it is malformed."""
    return _parse_cached(os.environ.get(ENV_NAME))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _auto_split_count(
    base_ctas: int, num_tiles: int, tile_tokens: int, slots: int, max_splits: int
) -> int:
    """Split count minimising the modelled stage-1 makespan plus the combine's cost.

    Makespan = waves x per-CTA work, where waves = ceil(CTAs / resident CTA slots): a grid that
    fills 1.1 waves costs as much as two full ones, which is the wave quantization that
    FlashAttention's heuristic weighs. ``slots`` is SMs x resident CTAs per SM.
    """
    best_splits, best_cost = 1, math.inf
    for splits in range(1, max_splits + 1):
        tiles_per_split = _cdiv(num_tiles, splits)
        if splits > 1 and tiles_per_split == _cdiv(num_tiles, splits - 1):
            # Same work per CTA as one split fewer, only more CTAs: never better.
            continue
        per_cta = tiles_per_split * tile_tokens + CTA_OVERHEAD_TOKENS
        cost = 0.0
        if splits > 1:
            per_cta += SPLIT_OVERHEAD_TOKENS
            cost += COMBINE_LAUNCH_TOKENS
        cost += _cdiv(base_ctas * splits, slots) * per_cta
        if cost < best_cost:
            best_splits, best_cost = splits, cost
    return best_splits


def split_count_for(
    target_ctas: int | None,
    *,
    batch: int,
    head_blocks: int,
    num_tiles: int,
    tile_tokens: int,
    num_sms: int,
    ctas_per_sm: int,
) -> int:
    """Number of KV splits for one launch; a pure function of the knob and the shapes.

    ``num_tiles`` is the number of ``tile_tokens``-token KV tiles per request (SWA and extra
    lists together). With ``target_ctas`` = N the result makes batch x head_blocks x splits
    about N; with None it is the automatic choice. Either way it is at least 1, at most one
    split per MIN_TOKENS_PER_SPLIT tokens, and no split is left empty. ``ctas_per_sm`` is how
    many stage-1 CTAs the compiled kernel keeps resident on one SM; the automatic choice fills
    whole waves of num_sms x ctas_per_sm.
    """
    if min(batch, head_blocks, num_tiles, tile_tokens, num_sms, ctas_per_sm) <= 0:
        raise ValueError(
            f"split_count_for needs positive shapes, got batch={batch}, "
            f"head_blocks={head_blocks}, num_tiles={num_tiles}, tile_tokens={tile_tokens}, "
            f"num_sms={num_sms}, ctas_per_sm={ctas_per_sm}"
        )
    min_tiles = max(1, _cdiv(MIN_TOKENS_PER_SPLIT, tile_tokens))
    max_splits = max(1, num_tiles // min_tiles)
    base_ctas = batch * head_blocks
    if target_ctas is None:
        wanted = _auto_split_count(
            base_ctas, num_tiles, tile_tokens, num_sms * ctas_per_sm, max_splits
        )
    else:
        wanted = max(1, (target_ctas + base_ctas // 2) // base_ctas)
    wanted = min(wanted, max_splits)
    # Equal tile counts per split; drop splits that this rounding would leave without a tile.
    return _cdiv(num_tiles, _cdiv(num_tiles, wanted))


_logged: set[tuple] = set()


def resolve_split_count(
    *,
    batch: int,
    head_blocks: int,
    num_tiles: int,
    tile_tokens: int,
    num_sms: int,
    ctas_per_sm: int,
) -> int:
    """split_count_for with the knob read from the environment; logs each new choice once.

    A choice is logged once per (knob, batch, head blocks, tiles): layers with and without an
    extra cache have different tile counts at the same batch size and so different splits.
    """
    raw = os.environ.get(ENV_NAME)
    target = _parse_cached(raw)
    splits = split_count_for(
        target,
        batch=batch,
        head_blocks=head_blocks,
        num_tiles=num_tiles,
        tile_tokens=tile_tokens,
        num_sms=num_sms,
        ctas_per_sm=ctas_per_sm,
    )
    key = (raw, batch, head_blocks, num_tiles, num_sms, ctas_per_sm)
    if key not in _logged:
        _logged.add(key)
        logger.info(
            "%s=%s (%s): batch %d, %d head blocks, %d KV tiles of %d tokens on %d SMs x %d "
            "resident CTAs -> %d splits, %d CTAs",
            ENV_NAME,
            AUTO if target is None else target,
            "unset" if raw is None else "set",
            batch,
            head_blocks,
            num_tiles,
            tile_tokens,
            num_sms,
            ctas_per_sm,
            splits,
            batch * head_blocks * splits,
        )
    return splits
