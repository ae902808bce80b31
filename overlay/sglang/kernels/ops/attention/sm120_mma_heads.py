"""How many query heads SM120 DSV4 attention hands the mma kernel: the rank's own.

Upstream pads the per-rank query to 64 heads (128 for a 128-head model above 64 per rank) for
every SM120 FlashMLA backend but FlashInfer with a kernel for the native count
(``MqaAttentionBase._kernel_num_heads`` in ``srt/models/deepseek_v4.py``). The pad serves
kernels specialised on the head count. The mma kernel takes any H >= 1: it masks the last,
partial head block, and every head's row is computed on its own. Padding 16 real heads (DSV4-Flash
at TP4) to 64 would launch four head blocks where one does, and each block gathers and
dequantizes the same KV again: four times the KV reads per layer, plus 48 rows of work that is
thrown away. Patch 0005 asks this module before upstream's padded default.

The attention sink needs nothing of ours: upstream's ``_local_attn_sink(kernel_num_heads)``
returns this rank's slice of the sink, cut to the width of the query it is given.
"""


def mma_kernel_num_heads(n_local_heads: int) -> int | None:
    """The head count to give the SM120 decode kernel when it is ours, else None.

    None leaves the choice to upstream (the flashinfer, triton and torch backends keep their
    shapes). The backend is the one upstream's dispatch resolved at import, so the query is
    shaped for the kernel that will actually run.
    """
    from sglang.kernels.ops.attention import flash_mla_sm120

    if flash_mla_sm120._sm120_default_backend == "mma" and n_local_heads >= 1:
        return n_local_heads
    return None
