"""Patch 0005: with the mma backend, SM120 DSV4 attention gives the kernel the rank's native head
count instead of padding the query to 64 heads; checked against the real upstream model code.

The attention layer's forward is driven on CPU up to the attention backend call (the backend is
a spy): the real head decision, query buffer and sink slice run. What cannot run here is named
in test_attention_forward_hands_the_backend_native_heads.
"""

import types

import pytest
import torch
from cases import Case, make_inputs
from sglang.kernels.ops.attention import flash_mla_sm120 as dispatch
from sglang.kernels.ops.attention import flash_mla_sm120_mma as mma
from sglang.kernels.ops.attention.sm120_mma_splits import ENV_NAME
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.models import deepseek_v4 as model
from torch import nn

DECODE_TOKENS = 8  # at most SM120_DECODE_MAX_TOKENS (64): the decode kernel's batch
PREFILL_TOKENS = 200  # above it: upstream's prefill path, native heads already
# (model heads, TP size): DSV4-Flash (64 heads) at TP 2, 4, 8 and DSV4-Pro (128) at TP 4.
MODELS = [(64, 2), (64, 4), (64, 8), (128, 4)]


@pytest.fixture
def sm120(monkeypatch):
    """Upstream's model code believes it runs on SM120; returns a backend switch."""
    monkeypatch.setattr(
        model,
        "get_platform",
        lambda: types.SimpleNamespace(is_sm120=True, is_sm100=False, is_blackwell=True),
    )

    def use(backend: str, flashinfer_has_kernel: bool = False):
        monkeypatch.setattr(dispatch, "_sm120_default_backend", backend)
        monkeypatch.setenv("SGLANG_SM120_FLASHMLA_BACKEND", backend)
        monkeypatch.setattr(
            dispatch,
            "flashinfer_dsv4_decode_supports_num_heads",
            lambda num_heads, num_tokens: flashinfer_has_kernel,
        )

    return use


def _attention(n_heads: int, tp: int, rank: int = 0) -> "model.MQALayer":
    """An MQALayer with just the state the head decision, the sink and forward's q path read."""
    layer = object.__new__(model.MQALayer)
    nn.Module.__init__(layer)
    layer.n_heads, layer.attn_tp_size, layer.attn_tp_rank = n_heads, tp, rank
    layer.n_local_heads = n_heads // tp
    layer.head_dim = 512
    layer.attn_sink = nn.Parameter(torch.randn(n_heads, generator=torch.Generator().manual_seed(3)))
    layer._attn_sink_local = None
    layer.alt_streams = None
    layer.use_mega_attention = False
    layer.is_dsv41 = False
    layer.compress_ratio = 4
    layer.attn_mqa = types.SimpleNamespace(layer_id=0, v_head_dim=512)
    return layer


def _upstream_padded(n_heads: int, tp: int) -> int:
    return 64 if n_heads // tp <= 64 else n_heads


@pytest.mark.parametrize("n_heads, tp", MODELS)
def test_mma_decode_gets_the_native_head_count(sm120, n_heads, tp):
    sm120("mma")
    layer = _attention(n_heads, tp)
    assert layer._kernel_num_heads(DECODE_TOKENS) == n_heads // tp
    assert layer._kernel_num_heads(PREFILL_TOKENS) == n_heads // tp


def test_tp4_dsv4_flash_with_mma_is_16_heads(sm120):
    sm120("mma")
    assert _attention(64, 4)._kernel_num_heads(DECODE_TOKENS) == 16


@pytest.mark.parametrize("backend", ["triton", "torch", "flashinfer"])
@pytest.mark.parametrize("n_heads, tp", MODELS)
def test_other_backends_keep_upstream_padding(sm120, backend, n_heads, tp):
    sm120(backend)
    layer = _attention(n_heads, tp)
    assert layer._kernel_num_heads(DECODE_TOKENS) == _upstream_padded(n_heads, tp)
    assert layer._kernel_num_heads(PREFILL_TOKENS) == n_heads // tp


def test_flashinfer_keeps_its_own_native_head_kernels(sm120):
    sm120("flashinfer", flashinfer_has_kernel=True)
    assert _attention(64, 4)._kernel_num_heads(DECODE_TOKENS) == 16


def test_single_rank_is_unchanged(sm120):
    for backend in ("mma", "triton"):
        sm120(backend)
        assert _attention(64, 1)._kernel_num_heads(DECODE_TOKENS) == 64


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_sink_is_this_ranks_slice_at_the_native_width(sm120, rank):
    sm120("mma")
    layer = _attention(64, 4, rank)
    heads = layer._kernel_num_heads(DECODE_TOKENS)
    sink = layer._local_attn_sink(heads)
    assert sink.shape == (16,)
    assert torch.equal(sink, layer.attn_sink.detach()[16 * rank : 16 * rank + 16])
    # The padded width other backends get keeps the same 16 values, then zeros.
    padded = layer._local_attn_sink(64)
    assert torch.equal(padded[:16], sink) and torch.all(padded[16:] == 0)


def _kernel_run(q, sink, kwargs):
    out, lse = mma.flash_mla_sparse_decode_mma(
        q,
        kwargs["k_cache"],
        kwargs["indices"],
        kwargs["topk_length"],
        sink,
        512,
        kwargs["softmax_scale"],
        kwargs["extra_k_cache"],
        kwargs["extra_indices_in_kvcache"],
        kwargs["extra_topk_length"],
    )
    return out, lse


@pytest.mark.parametrize("target", ["1", "100000"], ids=["one-split", "max-splits"])
@pytest.mark.parametrize("native", [8, 16, 32, 64])
def test_native_rows_equal_the_padded_rows_bit_for_bit(sm120, monkeypatch, native, target):
    """Each head's row is computed on its own, so the padding (uninitialised memory upstream)
    cannot change the real heads' output: same split count, same bits."""
    sm120("mma")
    monkeypatch.setenv(ENV_NAME, target)
    layer = _attention(native * 4, 4, rank=1)
    padded_heads = _upstream_padded(native * 4, 4)
    kwargs = make_inputs(Case(batch=3, heads=native, swa_topk=70, extra_topk=90, seed=5))
    q_native = kwargs["q"]
    q_padded = torch.empty(3, 1, padded_heads, 512, dtype=torch.bfloat16)
    q_padded.normal_(0, 30.0)  # what uninitialised padding could hold
    q_padded[:, :, :native] = q_native
    out_n, lse_n = _kernel_run(q_native, layer._local_attn_sink(native), kwargs)
    out_p, lse_p = _kernel_run(q_padded, layer._local_attn_sink(padded_heads), kwargs)
    assert torch.equal(out_n, out_p[:, :, :native])
    assert torch.equal(lse_n, lse_p[:, :native])


def test_attention_forward_hands_the_backend_native_heads(sm120, monkeypatch):
    """MQALayer.forward as far as CPU allows: the head decision, the query buffer and the sink
    slice run for real, up to ``attn_backend.forward``, which is a spy that stops the forward.

    Not run here: ``_forward_prepare`` (wq_a/wq_b GEMMs on FP8 weights, q norm, fused RoPE and
    the KV store: CUDA and Triton kernels; replaced by a stand-in that writes a known q into the
    buffer forward hands it) and the DeepseekV4 attention backend itself, whose forward needs the
    metadata that ``init_forward_metadata`` builds from a real KV pool (the spy runs our kernel
    on what it received instead)."""

    class Stop(Exception):
        pass

    received = []

    class SpyBackend:
        def forward(self, **kw):
            received.append(kw)
            raise Stop

    monkeypatch.setattr(model, "get_attn_backend", lambda: SpyBackend())
    prepared = torch.randn(DECODE_TOKENS, 16, 512, generator=torch.Generator().manual_seed(9))

    def prepare(x, positions, forward_batch, attn_backend, q_out, **_):
        q = q_out if q_out is not None else x.new_empty(x.shape[0], 16, 512)
        q.copy_(prepared)
        return q, None

    shapes = {}
    for backend in ("mma", "triton"):
        sm120(backend)
        layer = _attention(64, 4, rank=2)
        layer._forward_prepare = prepare
        batch = types.SimpleNamespace(forward_mode=ForwardMode.DECODE)
        x = torch.randn(DECODE_TOKENS, 64, dtype=torch.bfloat16)
        with pytest.raises(Stop):
            layer.forward(x, torch.zeros(DECODE_TOKENS, dtype=torch.int64), batch)
        kw = received.pop()
        shapes[backend] = (tuple(kw["q"].shape), tuple(kw["attn_sink"].shape))
        assert torch.equal(kw["q"][:, :16].float(), prepared.bfloat16().float())
        assert torch.equal(kw["attn_sink"][:16], layer.attn_sink.detach()[32:48])
    assert shapes["mma"] == ((DECODE_TOKENS, 16, 512), (16,))
    assert shapes["triton"] == ((DECODE_TOKENS, 64, 512), (64,))


@pytest.mark.parametrize("native", [8, 16, 32])
def test_bench_padded_heads_pads_as_upstream_does(sm120, native, monkeypatch):
    """bench/kernel/microbench --padded-heads times the call upstream made: its width is what the
    real _kernel_num_heads gives a backend without native heads, and its real rows are ours
    (bit for bit at the same split count: one split each here)."""
    from bench.kernel.microbench import padded_inputs

    monkeypatch.setenv("SGLANG_SM120_MMA_TARGET_CTAS", "1")
    sm120("triton")
    width = _attention(native * 4, 4)._kernel_num_heads(DECODE_TOKENS)
    sm120("mma")
    kwargs = make_inputs(Case(batch=2, heads=native, swa_topk=40, extra_topk=50, seed=2))
    padded = padded_inputs(torch, kwargs)
    assert padded["q"].shape == (2, 1, width, 512)
    assert torch.equal(padded["q"][:, :, :native], kwargs["q"])
    assert torch.equal(padded["attn_sink"][:native], kwargs["attn_sink"])
    assert torch.all(padded["attn_sink"][native:] == 0)
    out_n, lse_n = dispatch.flash_mla_with_kvcache_sm120(**kwargs)
    out_p, lse_p = dispatch.flash_mla_with_kvcache_sm120(**padded)
    assert torch.equal(out_p[:, :, :native], out_n)
    assert torch.equal(lse_p[:, :native], lse_n)
