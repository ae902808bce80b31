"""Patch 0006: a CPU engine starts without sgl_kernel's CPU build; the torch fallbacks keep the
contract of the Triton kernels they stand in for (run here in Triton's interpreter)."""

import os
import subprocess
import sys

import pytest
import torch
from sglang.srt.mem_cache.allocation import assign_req_to_token_pool
from sglang.srt.utils import sgl_kernel_cpu


def test_assign_req_to_token_pool_fallback_matches_upstreams_kernel():
    gen = torch.Generator().manual_seed(0)
    pool_len, batch = 64, 5
    req_pool_indices = torch.tensor([3, 0, 7, 2, 5], dtype=torch.int64)
    start = torch.randint(0, 20, (batch,), generator=gen)
    end = start + torch.randint(0, 30, (batch,), generator=gen)
    out_cache_loc = torch.randint(1, 10_000, (int((end - start).sum()),), generator=gen)
    ours = torch.zeros(8, pool_len, dtype=torch.int32)
    theirs = ours.clone()
    sgl_kernel_cpu.assign_req_to_token_pool(
        req_pool_indices, ours, start, end, out_cache_loc, pool_len
    )
    assign_req_to_token_pool[(batch,)](
        req_pool_indices, theirs, start, end, out_cache_loc, pool_len, 8
    )
    assert torch.equal(ours, theirs)
    assert ours.count_nonzero() == out_cache_loc.numel()


def test_copy_all_layer_kv_cache_fallback_copies_rows_in_every_buffer():
    layers = [torch.arange(40, dtype=torch.float32).view(10, 4) + 100 * i for i in range(3)]
    expected = [t.clone() for t in layers]
    tgt, src = torch.tensor([1, 7]), torch.tensor([4, 2])
    for t in expected:
        t[tgt] = t[src]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    sgl_kernel_cpu.copy_all_layer_kv_cache(ptrs, strides, tgt, src)
    for got, want in zip(layers, expected, strict=True):
        assert torch.equal(got, want)


def test_ops_without_a_fallback_refuse_with_a_clear_error(monkeypatch):
    # None in sys.modules makes `import sgl_kernel` fail, as where its CPU build is absent.
    monkeypatch.setitem(sys.modules, "sgl_kernel", None)
    op = sgl_kernel_cpu.cpu_op("verify_tree_greedy_cpu")
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu.*CPU build"):
        op()
    assert sgl_kernel_cpu.cpu_op("assign_req_to_token_pool_cpu") is (
        sgl_kernel_cpu.assign_req_to_token_pool
    )


def test_cpu_engine_modules_import_without_sgl_kernel():
    # With SGLANG_USE_CPU_ENGINE=1 these modules imported *_cpu ops from sgl_kernel at import
    # time; now they take them from sgl_kernel_cpu.
    code = (
        "import sys; sys.modules['sgl_kernel'] = None  # absent, whatever is installed\n"
        "import sglang.srt.mem_cache.allocation as a, sglang.kernels.ops.kvcache.cache_move as c\n"
        "import sglang.kernels.ops.speculative.eagle, sglang.kernels.ops.speculative.cache_locs\n"
        "import sglang.kernels.ops.speculative.spec_tree\n"
        "from sglang.srt.utils import sgl_kernel_cpu as f\n"
        "assert a.assign_req_to_token_pool_cpu is f.assign_req_to_token_pool\n"
        "assert c.copy_all_layer_kv_cache_cpu is f.copy_all_layer_kv_cache\n"
        "print('imported')\n"
    )
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imported" in done.stdout
