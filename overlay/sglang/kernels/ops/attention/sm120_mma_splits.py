"""How many CTAs the SM120 MMA sparse-decode kernel launches: the
``SGLANG_SM120_MMA_TARGET_CTAS`` knob and the automatic choice.

The kernel is stream-K: a call's work is W = rows x tiles units (a row is one head block of one
request, a unit one BLOCK_T-token KV tile of it), and C CTAs each take an equal contiguous share
of the W units (W / C, rounded down or up), so every CTA of a launch has the same work whatever
the batch. A row cut between CTAs costs each of them a partial output (16 heads x 512 bf16) and
costs the CTA that finishes the row a merge of them. The knob says how many CTAs to launch;
``auto`` (the default) fills one wave of the device (its SM count times the compiled kernel's
resident CTAs per SM) whenever the call has a unit for every slot, and otherwise picks the
count from a cost model of the tiles a CTA walks plus the pieces it writes and merges.

Standard library only, so the parser and the choice can be checked without torch or a GPU.
The variable is read from ``os.environ`` directly: it is registered in sglang's env registry as
a plain string (so ``envs.SGLANG_SM120_MMA_TARGET_CTAS.override(...)`` works), but the registry's
``get()`` turns a malformed value into a warning plus the default, and a mistyped knob must fail.
"""

import logging
import os
import re
from functools import lru_cache

logger = logging.getLogger(__name__)

ENV_NAME = "SGLANG_SM120_MMA_TARGET_CTAS"
AUTO = "auto"

# The cost model behind ``auto`` when the call has fewer units than the device has CTA slots,
# in tiles (one tile: BLOCK_T KV rows gathered and attended, the unit the kernel's loop advances
# by). They are estimates from the kernel's structure, not fitted to a graph-replay sweep on
# any GPU: fit them with bench/kernel/microbench (auto against fixed TARGET_CTAS values) on the
# target architecture.
# A CTA's cost besides its tiles: the launch ramp, the query block, the first gather that
# nothing overlaps.
CTA_OVERHEAD_TILES = 1.0
# Writing a piece of a cut row: 16 heads x 512 bf16 (16 KiB, about one tile's KV).
PIECE_WRITE_TILES = 1.0
# Reading one piece back in the merge (from L2, where the pieces of one call stay).
PIECE_MERGE_TILES = 0.5

_POSITIVE_INT = re.compile(r"[0-9]+")


def _knob_error(raw: str, why: str) -> ValueError:
    return ValueError(
        f"{ENV_NAME}={raw!r} is invalid ({why}); accepted: unset or {AUTO!r} for the automatic "
        f"choice, or a positive integer N (launch N CTAs, at most one per KV tile of the call)"
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


def cta_of(unit: int, num_ctas: int, num_units: int) -> int:
    """The CTA whose share [c W / C, (c + 1) W / C) holds ``unit`` (the kernel's rule)."""
    return ((unit + 1) * num_ctas - 1) // num_units


def pieces_per_row(rows: int, tiles: int, num_ctas: int) -> int:
    """The most CTAs any row is cut between when C CTAs share rows x tiles units."""
    units = rows * tiles
    return max(
        cta_of(r * tiles + tiles - 1, num_ctas, units) - cta_of(r * tiles, num_ctas, units) + 1
        for r in range(rows)
    )


def modelled_cost(rows: int, tiles: int, num_ctas: int) -> float:
    """The cost model, in tiles, of one wave of C CTAs over rows x tiles units: the longest
    share plus, where rows are cut, a piece written and the longest merge."""
    units = rows * tiles
    cost = _cdiv(units, num_ctas) + CTA_OVERHEAD_TILES
    pieces = pieces_per_row(rows, tiles, num_ctas)
    if pieces > 1:
        cost += PIECE_WRITE_TILES + pieces * PIECE_MERGE_TILES
    return cost


def _auto_cta_count(rows: int, tiles: int, slots: int) -> int:
    """One full wave when there is a unit for every slot (stream-K balances it exactly);
    otherwise the count, up to one CTA per unit, with the least modelled cost (the fewest CTAs
    among equals)."""
    units = rows * tiles
    if units >= slots:
        return slots
    return min(range(1, units + 1), key=lambda c: (modelled_cost(rows, tiles, c), c))


def cta_count_for(
    target_ctas: int | None,
    *,
    batch: int,
    head_blocks: int,
    num_tiles: int,
    num_sms: int,
    ctas_per_sm: int,
) -> int:
    """Number of stage-1 CTAs for one launch; a pure function of the knob and the shapes.

    ``num_tiles`` is the number of KV tiles per request (SWA and extra lists together). With
    ``target_ctas`` = N the result is N, at most one CTA per unit; with None it is the
    automatic choice (above), which counts slots as num_sms x ctas_per_sm (the compiled
    kernel's resident CTAs per SM). Either way every CTA has at least one unit.
    """
    if min(batch, head_blocks, num_tiles, num_sms, ctas_per_sm) <= 0:
        raise ValueError(
            f"cta_count_for needs positive shapes, got batch={batch}, "
            f"head_blocks={head_blocks}, num_tiles={num_tiles}, num_sms={num_sms}, "
            f"ctas_per_sm={ctas_per_sm}"
        )
    rows = batch * head_blocks
    units = rows * num_tiles
    if target_ctas is None:
        return _auto_cta_count(rows, num_tiles, num_sms * ctas_per_sm)
    return min(target_ctas, units)


_logged: set[tuple] = set()


def resolve_cta_count(
    *,
    batch: int,
    head_blocks: int,
    num_tiles: int,
    tile_tokens: int,
    num_sms: int,
    ctas_per_sm: int,
) -> int:
    """cta_count_for with the knob read from the environment; logs each new choice once.

    A choice is logged once per (knob, batch, head blocks, tiles): layers with and without an
    extra cache have different tile counts at the same batch size and so different choices.
    """
    raw = os.environ.get(ENV_NAME)
    target = _parse_cached(raw)
    ctas = cta_count_for(
        target,
        batch=batch,
        head_blocks=head_blocks,
        num_tiles=num_tiles,
        num_sms=num_sms,
        ctas_per_sm=ctas_per_sm,
    )
    key = (raw, batch, head_blocks, num_tiles, num_sms, ctas_per_sm)
    if key not in _logged:
        _logged.add(key)
        slots = num_sms * ctas_per_sm
        logger.info(
            "%s=%s (%s): batch %d, %d head blocks, %d KV tiles of %d tokens on %d SMs x %d "
            "resident CTAs -> %d CTAs, %.1f tiles each, %d%% of the wave's slots",
            ENV_NAME,
            AUTO if target is None else target,
            "unset" if raw is None else "set",
            batch,
            head_blocks,
            num_tiles,
            tile_tokens,
            num_sms,
            ctas_per_sm,
            ctas,
            batch * head_blocks * num_tiles / ctas,
            round(100 * ctas / (_cdiv(ctas, slots) * slots)),
        )
    return ctas
