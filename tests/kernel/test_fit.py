"""CUDA's per-architecture limits, resident CTAs per SM, and the launch configuration per device
(pure Python; the compiled facts these rest on are checked by test_kernel_audit.py)."""

import pytest
from sglang.kernels.ops.attention.sm120_mma_fit import (
    ARCH_LIMITS,
    config_for,
    limits_for_arch,
    occupancy,
    stage1_shared_model,
)


def test_sm120_and_sm121_allow_99_kib_per_block_and_sm90_227():
    assert limits_for_arch(120).max_shared_per_block == 101_376
    assert limits_for_arch(121).max_shared_per_block == 101_376
    assert limits_for_arch(90).max_shared_per_block == 232_448
    assert limits_for_arch(120).max_threads_per_sm == 1536
    assert limits_for_arch(90).max_threads_per_sm == 2048


def test_unknown_architecture_takes_the_reported_shared_memory_and_conservative_rest():
    limits = limits_for_arch(75, 65_536 - 1024)
    assert limits.max_shared_per_block == 65_536 - 1024
    assert limits.max_threads_per_sm == min(a.max_threads_per_sm for a in ARCH_LIMITS.values())


@pytest.mark.parametrize(
    "regs, shared, warps, arch, ctas, limit",
    [
        # The stage-1 kernel before it was fitted: 212 registers at 8 warps fit one CTA.
        (212, 1024, 8, 120, 1, "registers"),
        # 128 registers x 256 threads is half the register file.
        (128, 49_152, 8, 120, 2, "registers"),
        # 49,152 B + 1 KiB reserved, twice, is 100,352 B of sm_120's 102,400.
        (64, 49_152, 8, 120, 2, "shared memory"),
        (64, 49_152, 4, 90, 4, "shared memory"),
        # 131,200 B is over sm_120's per-block limit: the kernel cannot launch at all.
        (100, 131_200, 8, 120, 0, "shared memory"),
        (32, 0, 8, 120, 6, "threads"),
        (16, 0, 1, 90, 32, "blocks"),
    ],
)
def test_occupancy_counts_the_limiting_resource(regs, shared, warps, arch, ctas, limit):
    occ = occupancy(regs, shared, warps, limits_for_arch(arch))
    assert (occ.ctas_per_sm, occ.limited_by) == (ctas, limit)


def test_registers_are_allocated_per_warp_in_units_of_256():
    # 129 registers round up to 136 per thread: 4,352 per warp, 15 warps per SM, one 8-warp CTA.
    assert occupancy(129, 0, 8, limits_for_arch(120)).ctas_per_sm == 1
    assert occupancy(128, 0, 8, limits_for_arch(120)).ctas_per_sm == 2


@pytest.mark.parametrize("arch", [90, 120, 121])
def test_config_is_prefetched_32_row_tiles_where_they_fit(arch):
    limits = limits_for_arch(arch)
    cfg = config_for(arch, limits.max_shared_per_block)
    assert (cfg.block_h, cfg.block_t, cfg.num_warps, cfg.num_stages) == (16, 32, 8, 1)
    assert (cfg.prefetch, cfg.ctas_per_sm) == (1, 1)
    per_cta = stage1_shared_model(cfg.block_h, cfg.block_t) + limits.reserved_shared_per_block
    assert cfg.ctas_per_sm * per_cta <= limits.shared_per_sm


def test_config_on_a_small_device_takes_16_row_tiles():
    # 48 KiB per block holds the 16-row tile's 36,864 B but not the 32-row tile's 53,248 B
    # (both compiled figures: bench/kernel/audit --stage1-config 16,16,8,1 and the default).
    assert stage1_shared_model(16, 16) == 36_864 and stage1_shared_model(16, 32) == 53_248
    for arch in (75, 120):
        cfg = config_for(arch, 48 * 1024)
        assert (cfg.block_t, cfg.prefetch, cfg.ctas_per_sm) == (16, 1, 1)
