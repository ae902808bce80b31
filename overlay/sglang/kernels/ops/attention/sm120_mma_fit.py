"""How the SM120 MMA sparse-decode kernel fits a GPU: per-architecture limits, the launch
configuration for a device, and resident CTAs per SM of a compiled kernel.

Standard library only, so the audit (``bench/kernel/audit``) and the tests can use it without a
GPU. The limits are CUDA's "Technical Specifications per Compute Capability" table (CUDA C++
Programming Guide; the same values are in libcu++'s ``cuda/__device/arch_traits.h``): shared
memory per SM and the 1 KiB the runtime reserves per block, resident threads and blocks per SM,
and 64 Ki 32-bit registers per SM, allocated per warp in units of 256.
"""

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_REGS_PER_SM = 64 * 1024
_REG_ALLOC_UNIT = 256  # registers, per warp
_RESERVED_SHARED_PER_BLOCK = 1024


@dataclass(frozen=True)
class ArchLimits:
    arch: int  # compute capability as major * 10 + minor
    shared_per_sm: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    regs_per_sm: int = _REGS_PER_SM
    reserved_shared_per_block: int = _RESERVED_SHARED_PER_BLOCK

    @property
    def max_shared_per_block(self) -> int:
        """The opt-in maximum one block may use (what Triton's driver reports as max_shared_mem)."""
        return self.shared_per_sm - self.reserved_shared_per_block

    @property
    def regs_per_block(self) -> int:
        return self.regs_per_sm


_KIB = 1024
ARCH_LIMITS = {
    a.arch: a
    for a in (
        ArchLimits(80, 164 * _KIB, 2048, 32),
        ArchLimits(86, 100 * _KIB, 1536, 16),
        ArchLimits(87, 164 * _KIB, 1536, 16),
        ArchLimits(89, 100 * _KIB, 1536, 24),
        ArchLimits(90, 228 * _KIB, 2048, 32),
        ArchLimits(100, 228 * _KIB, 2048, 32),
        ArchLimits(103, 228 * _KIB, 2048, 32),
        ArchLimits(120, 100 * _KIB, 1536, 24),
        ArchLimits(121, 100 * _KIB, 1536, 24),
    )
}


def limits_for_arch(arch: int, max_shared_per_block: int | None = None) -> ArchLimits:
    """CUDA's limits for ``arch``; for an architecture not in the table, the most conservative
    row of the table, with the shared memory the device itself reports when it is given."""
    known = ARCH_LIMITS.get(arch)
    if known is not None:
        return known
    shared = (
        max_shared_per_block + _RESERVED_SHARED_PER_BLOCK
        if max_shared_per_block
        else min(a.shared_per_sm for a in ARCH_LIMITS.values())
    )
    return ArchLimits(arch, shared, 1536, 16)


@dataclass(frozen=True)
class Occupancy:
    """Resident CTAs per SM of one compiled kernel, and which resource limits it."""

    ctas_per_sm: int
    limited_by: str
    by_registers: int
    by_shared: int
    by_threads: int

    def __str__(self) -> str:
        return f"{self.ctas_per_sm} CTA/SM ({self.limited_by})"


def occupancy(registers: int, shared_bytes: int, num_warps: int, limits: ArchLimits) -> Occupancy:
    """CTAs of one kernel that fit on an SM at once, as CUDA's occupancy calculator counts them.

    0 means the kernel cannot be resident at all (it would fail to launch).
    """
    regs_per_warp = -(-max(registers, 1) * 32 // _REG_ALLOC_UNIT) * _REG_ALLOC_UNIT
    by_regs = (limits.regs_per_sm // regs_per_warp) // num_warps
    if shared_bytes > limits.max_shared_per_block:
        by_shared = 0
    else:
        by_shared = limits.shared_per_sm // (shared_bytes + limits.reserved_shared_per_block)
    by_threads = limits.max_threads_per_sm // (num_warps * 32)
    counts = {
        "registers": by_regs,
        "shared memory": by_shared,
        "threads": by_threads,
        "blocks": limits.max_blocks_per_sm,
    }
    limit = min(counts, key=counts.get)
    return Occupancy(counts[limit], limit, by_regs, by_shared, by_threads)


@dataclass(frozen=True)
class LaunchConfig:
    """Stage 1's tile sizes and schedule on one kind of device."""

    block_h: int  # query heads per program: the M of the MMA (16 is mma.sync's smallest)
    block_t: int  # KV tokens gathered and dequantized per loop iteration
    num_warps: int
    num_stages: int  # software-pipelining depth Triton gives the loop's loads
    # Tiles whose KV loads are in flight ahead of the one being computed (our own pipeline,
    # in registers: 1 = the next tile's KV and the tile after's indices).
    prefetch: int
    # Resident CTAs per SM this configuration is sized for on its architectures. The audit
    # checks that the compiled kernel reaches it; the launcher uses it only where there is no
    # compiled kernel to read (Triton's interpreter).
    ctas_per_sm: int


# Every tile constant of stage 1, in one place.
#
# Stage 1 keeps three things in shared memory: the dequantization-free KV tile as bf16 (8 groups
# x BLOCK_T rows x 64 columns; one buffer serves as the A operand of the scores KV.q^T and as
# the B operand of P.V), the query block q^T (8 groups x 64 x BLOCK_H, the scores' B operand,
# loaded once per row and read from shared memory every tile) and 4 KiB of scratch that Triton
# allocates for the cross-warp sum of the groups' scores and the layout conversions around it
# (4,096 B at 16-, 32- and 64-row tiles alike: bench/kernel/audit --stage1-config
# 16,T,8,1). Compiled by Triton 3.8 for sm_90, sm_120 and sm_121, stage 1's shared memory is
# exactly this (bench/kernel/audit prints the compiled figure, and
# tests/kernel/test_kernel_audit.py checks that it equals the model).
_HEAD_DIM = 512
_BF16 = 2
_REDUCTION_SCRATCH = 4096


def stage1_shared_model(block_h: int, block_t: int) -> int:
    return _BF16 * _HEAD_DIM * (block_h + block_t) + _REDUCTION_SCRATCH


BLOCK_H = 16  # mma.sync's M: the smallest head block a tensor-core tile serves
# One warp per 64-column group of the 512-wide head dim: the kernel's batched tl.dot puts the
# 8 groups on the 8 warps, so each MMA of a tile is issued once (bench/kernel/audit prints the
# tile loop's MMA against the tile's minimum).
NUM_WARPS = 8
# Triton's own pipelining (num_stages > 1) would stage the next tile's raw bytes in shared
# memory; the loop is pipelined by hand in registers instead (PREFETCH).
NUM_STAGES = 1
# The configurations stage 1 may take, the preferred first; a device gets the first whose
# shared memory fits one CTA. Preferred: 32-row tiles with the next tile's KV in flight during
# the current tile's math (53,248 B of shared memory and at most 255 registers on sm_120 and
# sm_90, no spill: one CTA per SM, limited by registers, and 2 x 32 x 584 = 37,376 B of KV
# requested at once per SM: bench/kernel/audit --targets rtx-pro-6000 --heads 16 --batch 64
# --extra c4-512 --sink on --lengths on). A second tile ahead would double the bytes in flight
# per SM, which a GPU with a high bandwidth per SM needs to cover memory latency (an H200:
# 4.8 TB/s over 132 SMs, datasheet); it fits in registers (253) only without the branch that
# skips an empty tile's math, and spills with it, so the kernel keeps one tile ahead and the
# skip. Smaller devices take 16-row tiles.
CONFIGS = (
    # (block_t, prefetch, resident CTAs per SM the compiled kernel reaches)
    (32, 1, 1),
    (16, 1, 1),
)


def config_for(arch: int, max_shared_per_block: int) -> LaunchConfig:
    """Stage 1's configuration on a device, from its architecture and the shared memory per
    block it reports: the first of CONFIGS whose shared memory fits the device."""
    limits = limits_for_arch(arch, max_shared_per_block)
    per_sm = min(limits.shared_per_sm, max_shared_per_block + limits.reserved_shared_per_block)
    for config in CONFIGS:
        block_t, _, ctas = config
        if (
            ctas * (stage1_shared_model(BLOCK_H, block_t) + limits.reserved_shared_per_block)
            <= per_sm
        ):
            break
    block_t, prefetch, ctas = config
    return LaunchConfig(BLOCK_H, block_t, NUM_WARPS, NUM_STAGES, prefetch, ctas)
