"""What one decode call costs the host: the torch ops and Triton launches of a call whose launch
plan is cached. Counted, not timed (our machines are noisy); the time itself is measured on a
GPU by bench/kernel/microbench (host µs per call).

The Triton kernel is replaced by a recorder for the counted call, so what is counted is
the launcher's own work; their numerics are checked in test_mma_decode.py.
"""

import pytest
from cases import Case, make_inputs, reference_args
from sglang.kernels.ops.attention import flash_mla_sm120_mma as mma
from sglang.kernels.ops.attention.sm120_mma_splits import ENV_NAME
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops per call: the output and the lse allocation. Nothing else: no slice, view, copy,
# fill, zeroing of the row counters or device-to-host read.
OPS_BUDGET = 2


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Recorder:
    def __init__(self, name: str, launches: list):
        self._name, self._launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launches.append((self._name, grid))


def _count(args) -> tuple[list[str], list[tuple]]:
    launches: list[tuple] = []
    real = mma._sparse_decode_split_kernel
    mma._sparse_decode_split_kernel = _Recorder("stage1", launches)
    try:
        mma.flash_mla_sparse_decode_mma(*args)  # builds and caches the plan
        launches.clear()
        with _CountOps() as counter:
            mma.flash_mla_sparse_decode_mma(*args)
    finally:
        mma._sparse_decode_split_kernel = real
    return counter.ops, launches


@pytest.mark.parametrize(
    "case",
    [
        Case(batch=4, heads=16, swa_topk=128, extra_topk=512),
        Case(batch=2, heads=64, swa_topk=128, with_lengths=False),
    ],
    ids=str,
)
@pytest.mark.parametrize("target", ["1", "7", "100000"])
def test_every_cta_count_is_one_launch_and_two_allocations(case, target, monkeypatch):
    # Cut rows are merged inside the launch by the CTA that finishes them: no second kernel.
    monkeypatch.setenv(ENV_NAME, target)
    ops, launches = _count(reference_args(make_inputs(case)))
    assert len(ops) <= OPS_BUDGET, ops
    ((name, grid),) = launches
    assert name == "stage1" and len(grid) == 1 and grid[0] > 0


def test_plan_is_made_once_per_shape_and_again_when_the_knob_changes(monkeypatch):
    monkeypatch.setattr(mma, "_plans", {})
    args = reference_args(make_inputs(Case(batch=2, heads=16, swa_topk=64)))
    monkeypatch.setenv(ENV_NAME, "1")
    _count(args)
    _count(args)
    assert len(mma._plans) == 1
    monkeypatch.setenv(ENV_NAME, "100000")
    _count(args)
    assert sorted(p.num_ctas for p in mma._plans.values()) == [1, 2 * 2]
