"""Patch 0008: prefill's KV send path on a CPU engine (KV indices in host memory).

Upstream's `_send_kv_chunk` gives a sender that takes host index tensors (Mooncake's) a pinned
copy of the page indices and a CUDA event to wait on. On a CPU engine there is neither a driver
nor a stream, so that path raised before any KV moved. With the patch, host-side indices take the
plain path: the page indices are computed in place and handed over without an event.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin


class HostIndexSender:
    """A sender like Mooncake's (supports_host_tensor_indices) that records what it is given."""

    supports_host_tensor_indices = True

    def __init__(self):
        self.kv_mgr = SimpleNamespace(enable_all_cp_ranks_for_transfer=False)
        self.sent = []

    def get_max_transfer_tokens(self):
        return None

    def should_send_kv_chunk(self, num_pages, is_last):
        return True

    def send(self, page_indices, state_indices, **kwargs):
        self.sent.append((page_indices, state_indices, kwargs))


def _scheduler(page_size: int, req_to_token: torch.Tensor):
    return SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(
            page_size=page_size, translate_kv_indices_for_transfer=lambda indices: indices
        ),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        enable_staging=False,
        disagg_prefill_pending_chunk_rids=set(),
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_chunk_of_host_kv_is_sent_without_pinned_memory_or_an_event(page_size):
    # Request row 1 holds KV slots 64..95: 32 tokens, of which a non-last chunk sends 0..24.
    req_to_token = torch.zeros((2, 64), dtype=torch.int64)
    req_to_token[1, :32] = torch.arange(64, 96)
    sender = HostIndexSender()
    req = SimpleNamespace(
        rid="r1",
        start_send_idx=0,
        origin_input_ids=list(range(32)),
        extend_end=24,
        kv=SimpleNamespace(req_pool_idx=1),
        disagg_kv_sender=sender,
        disagg_decode_prefix_len=0,
    )
    scheduler = _scheduler(page_size, req_to_token)

    SchedulerDisaggregationPrefillMixin._send_kv_chunk(scheduler, req, last_chunk=False)

    assert len(sender.sent) == 1
    page_indices, state_indices, kwargs = sender.sent[0]
    assert "indices_event" not in kwargs
    assert kwargs["num_kv_tokens"] == 24
    assert state_indices is None
    expected = list(range(64 // page_size, (64 + 24) // page_size))
    assert [int(i) for i in page_indices] == expected
    assert req.start_send_idx == 24
    assert scheduler.disagg_prefill_pending_chunk_rids == {"r1"}
