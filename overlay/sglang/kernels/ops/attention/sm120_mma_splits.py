"""How many KV splits the SM120 MMA sparse-decode kernel launches: the
``SGLANG_SM120_MMA_TARGET_CTAS`` knob and the automatic choice.

The stage-1 grid is ``batch x head_blocks x splits`` programs (CTAs). Few CTAs leave SMs idle;
many splits multiply the partial outputs that the combine has to read back. The knob says how
many CTAs to aim for; ``auto`` (the default) picks the split count from a wave model of the
device (its SM count and the compiled kernel's resident CTAs per SM), in the spirit of
FlashAttention's ``num_splits_heuristic`` and FlashInfer's SM120 planner.

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

# The wave model behind ``auto``. A stage-1 CTA's time is counted in tiles (one tile: BLOCK_T
# KV rows gathered and attended, the unit the kernel's loop advances by); a launch of C CTAs on
# S SMs x R resident CTAs runs in ceil(C / (S x R)) waves. The constants are the model's fixed
# costs in tiles. They are estimates from the kernel's structure, not yet fitted to a
# graph-replay sweep on any GPU: fit them with bench/kernel/microbench (auto against fixed
# TARGET_CTAS values) on the target architecture.
# A CTA's cost besides its tiles: the launch ramp, the 16 KiB query block, the pipeline's
# first gather that nothing overlaps.
CTA_OVERHEAD_TILES = 1.0
# A split's extra cost: its 16-head x 512 bf16 partial (16 KiB, about one tile's KV) is written
# by stage 1 and read again by the combine.
SPLIT_OVERHEAD_TILES = 1.0
# Launching the combine kernel at all: a second launch and its dependent start.
COMBINE_LAUNCH_TILES = 1.0
# Above this many waves a split count is not considered: the tail effects the model ignores
# grow with the wave count (FlashInfer's SM120 planner uses the same bound).
MAX_WAVES = 3

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


def _auto_split_count(base_ctas: int, num_tiles: int, slots: int) -> int:
    """Split count minimising the modelled makespan: waves x (tiles per CTA + overhead), plus
    the split and combine costs, over split counts of at most MAX_WAVES waves.

    A batch that fills a wave on its own (base_ctas >= slots) gets one split: splitting it
    could only add waves, partials and the combine. A small batch gets enough CTAs that each
    walks one or two tiles, as far as one wave allows.
    """
    if base_ctas >= slots:
        return 1
    best_splits, best_cost = 1, math.inf
    for splits in range(1, num_tiles + 1):
        tiles_per_split = _cdiv(num_tiles, splits)
        if splits > 1 and tiles_per_split == _cdiv(num_tiles, splits - 1):
            # Same work per CTA as one split fewer, only more CTAs: never better.
            continue
        waves = _cdiv(base_ctas * splits, slots)
        if waves > MAX_WAVES:
            break
        per_cta = tiles_per_split + CTA_OVERHEAD_TILES
        cost = waves * per_cta
        if splits > 1:
            cost += waves * SPLIT_OVERHEAD_TILES + COMBINE_LAUNCH_TILES
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
    about N; with None it is the automatic choice (the wave model above). Either way it is at
    least 1, at most one split per tile, and no split is left empty. ``ctas_per_sm`` is how
    many stage-1 CTAs the compiled kernel keeps resident on one SM; the automatic choice counts
    waves of num_sms x ctas_per_sm.
    """
    if min(batch, head_blocks, num_tiles, tile_tokens, num_sms, ctas_per_sm) <= 0:
        raise ValueError(
            f"split_count_for needs positive shapes, got batch={batch}, "
            f"head_blocks={head_blocks}, num_tiles={num_tiles}, tile_tokens={tile_tokens}, "
            f"num_sms={num_sms}, ctas_per_sm={ctas_per_sm}"
        )
    base_ctas = batch * head_blocks
    if target_ctas is None:
        wanted = _auto_split_count(base_ctas, num_tiles, num_sms * ctas_per_sm)
    else:
        wanted = max(1, (target_ctas + base_ctas // 2) // base_ctas)
    wanted = min(wanted, num_tiles)
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
