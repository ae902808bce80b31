"""A prefill scheduler built from real upstream pieces, small enough for a CPU test.

The scheduler object carries the real SchedulerDisaggregationPrefillMixin
methods; its pools (req_to_token rows, token allocator, metadata buffer slots)
and tree cache are the real upstream classes at tiny sizes. KV senders are the
real CommonKVSender over a CommonKVManager whose __init__ (sockets, bootstrap
registration) is skipped: a test moves a room through KVPoll states with the
manager's own update_status, as its bootstrap and transfer threads would.
Polls are MIN-all-reduced over real gloo process groups.
"""

from __future__ import annotations

import collections
import datetime
import gc
import json
import multiprocessing
import os
import socket
import tempfile
import threading
import time
import traceback
from array import array
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from sglang.srt import runtime_context
from sglang.srt.server_args import ServerArgs

# Published before the upstream modules below are used: they read the process
# config (disaggregation mode, parallel ranks) through runtime_context.
# A config-only model directory: server-args resolution reads the model's
# config, and nothing here loads weights.
_MODEL_DIR = tempfile.mkdtemp(prefix="pd-tiny-model-")
with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
    json.dump(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "num_hidden_layers": 1,
            "vocab_size": 128,
            "max_position_embeddings": 256,
        },
        f,
    )
_SERVER_ARGS = ServerArgs(
    model_path=_MODEL_DIR,
    disaggregation_mode="prefill",
    device="cpu",
)
runtime_context.publish(_SERVER_ARGS, role="scheduler")
runtime_context.get_parallel().override_permanently(tp_rank=0)

from sglang.srt.disaggregation.base import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import (  # noqa: E402
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue  # noqa: E402
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin  # noqa: E402
from sglang.srt.disaggregation.utils import (  # noqa: E402
    DisaggregationMode,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
)
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

BOOTSTRAP_TIMEOUT_S = 300
# SGLANG_DISAGGREGATION_WAITING_TIMEOUT's upstream default, as a decode-mode
# manager reads it at startup.
WAITING_TIMEOUT_S = 300
GROUP_TIMEOUT = datetime.timedelta(seconds=30)


class FakeClock:
    """Replaces time.time and time.monotonic; only a test moves it."""

    def __init__(self, start: float = 1_000_000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class RecordingStreamer:
    """What the scheduler would send to the tokenizer manager, i.e. the client."""

    streamed: list = field(default_factory=list)

    def stream_output(self, reqs, *args, **kwargs) -> None:
        self.streamed.extend(reqs)


@dataclass
class MetricsReporter:
    enable_metrics: bool = True
    current_scheduler_metrics_enabled: bool = True
    kv_transfer_latency_ms: float = 0.0
    kv_transfer_speed_gb_s: float = 0.0


class FailureCounters:
    """Counts the collector's failure increments as its prometheus counters
    would; the real collector registers process-global metric names and cannot
    be built once per test."""

    def __init__(self):
        self.transfer_failed = 0
        self.bootstrap_failed = 0

    def increment_transfer_failed_reqs(self) -> None:
        self.transfer_failed += 1

    def increment_bootstrap_failed_reqs(self) -> None:
        self.bootstrap_failed += 1


def make_pools(rows: int, tokens: int) -> tuple[ReqToTokenPool, TokenToKVPoolAllocator, RadixCache]:
    """req_to_token rows, a token allocator and a disabled radix cache over them."""
    req_to_token_pool = ReqToTokenPool(
        size=rows, max_context_len=64, device="cpu", enable_memory_saver=False
    )
    allocator = TokenToKVPoolAllocator(
        size=tokens, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False
    )
    tree_cache = RadixCache(
        CacheInitParams(
            disable=True,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            page_size=1,
        )
    )
    return req_to_token_pool, allocator, tree_cache


def make_req(rid: str, room: int, input_len: int) -> Req:
    """A request with a prompt of input_len tokens, bootstrapped on loopback for `room`."""
    req = Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", range(1, input_len + 1)),
        sampling_params=SamplingParams(max_new_tokens=8),
    )
    req.bootstrap_host = "127.0.0.1"
    req.bootstrap_room = room
    return req


def hold_prompt_kv(req: Req, rows: ReqToTokenPool, allocator: TokenToKVPoolAllocator) -> None:
    """Give the request a req_to_token row and KV tokens for its whole prompt."""
    input_len = len(req.origin_input_ids)
    rows.alloc([req])
    locs = allocator.alloc(input_len)
    rows.write((req.kv.req_pool_idx, slice(0, input_len)), locs.int())
    req.kv.kv_allocated_len = input_len
    req.kv.kv_committed_len = input_len


class MiniPrefillScheduler(SchedulerDisaggregationPrefillMixin):
    """The state process_disagg_prefill_inflight_queue and its failure path read."""

    _release_aborted_request = Scheduler._release_aborted_request

    def __init__(self, group: dist.ProcessGroup, rows: int = 4, tokens: int = 128):
        self.scheduler_stage_metrics = None
        self.disagg_prefill_inflight_queue: list[Req] = []
        self.disagg_prefill_pending_chunk_rids: set[str] = set()
        self.attn_tp_cpu_group = group
        self.attn_cp_cpu_group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, GROUP_TIMEOUT)
        self.req_to_token_pool, self.token_to_kv_pool_allocator, self.tree_cache = make_pools(
            rows, tokens
        )
        self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(rows)
        self.output_streamer = RecordingStreamer()
        self.metrics_reporter = MetricsReporter()
        self.metrics_collector = FailureCounters()
        self.kv_manager = make_kv_manager()

    def free_counts(self) -> dict[str, int]:
        return {
            "req_to_token rows": self.req_to_token_pool.available_size(),
            "kv tokens": self.token_to_kv_pool_allocator.available_size(),
            "metadata buffers": self.req_to_metadata_buffer_idx_allocator.available_size(),
            "tree protected tokens": self.tree_cache.protected_size(),
        }

    def admit_finished_prefill(self, rid: str, room: int, input_len: int = 5) -> Req:
        """Take a request through what admission and its prefill forward leave
        behind (tree lock, row, KV tokens, metadata slot, first output token),
        then append it to the inflight queue as process_batch_result does."""
        req = make_req(rid, room, input_len)
        req.init_next_round_input(self.tree_cache)
        req.lock = self.tree_cache.lock(req.last_node)
        hold_prompt_kv(req, self.req_to_token_pool, self.token_to_kv_pool_allocator)
        req.metadata_buffer_index = self.req_to_metadata_buffer_idx_allocator.alloc()
        req.disagg_kv_sender = CommonKVSender(self.kv_manager, "127.0.0.1:0", room)
        req.output_ids.append(7)
        self.disagg_prefill_inflight_queue.append(req)
        return req

    def set_status(self, req: Req, status: int) -> None:
        """What the bootstrap thread (WaitingForInput) or the transfer worker
        (Transferring, Success) does to a room."""
        self.kv_manager.update_status(req.bootstrap_room, status)

    def tick(self) -> list[Req]:
        return self.process_disagg_prefill_inflight_queue()


def _bare_kv_manager(mode: DisaggregationMode) -> CommonKVManager:
    """A CommonKVManager without sockets, bootstrap or engine registration: the
    fields its status and failure methods use on either side."""
    mgr = CommonKVManager.__new__(CommonKVManager)
    mgr.disaggregation_mode = mode
    mgr.is_dummy_cp_rank = False
    mgr.request_status = {}
    mgr.failure_records = {}
    mgr.failure_lock = threading.Lock()
    mgr._staging_outstanding = {}
    mgr._deferred_ack_targets = {}
    mgr._deferred_ack_poisoned_rooms = set()
    mgr.transfer_infos = {}
    mgr.req_to_decode_prefix_len = {}
    mgr.enable_deferred_decode_kv_release = False
    return mgr


def make_kv_manager() -> CommonKVManager:
    """A prefill-mode manager: plus what its senders read."""
    mgr = _bare_kv_manager(DisaggregationMode.PREFILL)
    mgr.bootstrap_timeout = BOOTSTRAP_TIMEOUT_S
    mgr.kv_item_lens_sum = 576
    mgr.state_item_lens_sum = 0
    mgr._kv_replica_factor = 1
    return mgr


class NoReasoning:
    """The batch-result processor's reasoning-token hook, for a request that
    does not reason."""

    def _maybe_update_reasoning_tokens(self, req, token_id) -> None:
        pass


class MiniDecodeScheduler:
    """The scheduler fields the decode transfer queue reads."""

    enable_decode_hicache = False
    enable_hisparse = False
    kv_checksum_computer = None
    disagg_decode_prealloc_queue = None

    def __init__(self):
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.output_streamer = RecordingStreamer()
        self.metrics_reporter = MetricsReporter()
        self.metrics_collector = FailureCounters()
        self.batch_result_processor = NoReasoning()


class MiniDecodeTransferQueue(DecodeTransferQueue):
    """Upstream's DecodeTransferQueue over tiny real pools. Only __init__ is
    replaced: it reads the parallel groups and the decode flags from the
    runtime context; this sets the same fields for one rank of `group` with
    staging, host receive and deferred release off (their defaults)."""

    def __init__(self, group: dist.ProcessGroup, rows: int = 4, tokens: int = 128):
        self.queue = []
        self.gloo_group = group
        self.tp_rank = group.rank()
        self.scheduler = MiniDecodeScheduler()
        self.spec_algorithm = self.scheduler.spec_algorithm
        self.enable_host_receive = False
        self._skipped_checksum_signatures = set()
        self.enable_staging = False
        self.staging_handler = None
        self.enable_deferred_kv_release = False
        self.deferred_kv_release_timeout = 0
        self._deferred_releases = []
        self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(rows)
        self.metadata_buffers = MetadataBuffers(
            rows, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=1
        )
        self.req_to_token_pool, self.token_to_kv_pool_allocator, self.tree_cache = make_pools(
            rows, tokens
        )
        self.kv_manager = make_decode_kv_manager()

    def free_counts(self) -> dict[str, int]:
        return {
            "req_to_token rows": self.req_to_token_pool.available_size(),
            "kv tokens": self.token_to_kv_pool_allocator.available_size(),
            "metadata buffers": self.req_to_metadata_buffer_idx_allocator.available_size(),
        }

    def admit_preallocated(self, rid: str, room: int, input_len: int = 5) -> DecodeRequest:
        """Take a request through what the prealloc queue leaves behind (a
        bootstrapped receiver, a req_to_token row and KV tokens for the prompt,
        a metadata slot, the destination sent to prefill) and append it to the
        transfer queue as pop_preallocated's caller does."""
        req = make_req(rid, room, input_len)
        receiver = CommonKVReceiver(self.kv_manager, "127.0.0.1:0", room)
        # init() with the "early" allocation policy, then send_metadata().
        self.kv_manager.update_status(room, KVPoll.WaitingForInput)
        receiver.init_time = time.time()
        hold_prompt_kv(req, self.req_to_token_pool, self.token_to_kv_pool_allocator)
        decode_req = DecodeRequest(
            req=req,
            kv_receiver=receiver,
            waiting_for_input=True,
            metadata_buffer_index=self.req_to_metadata_buffer_idx_allocator.alloc(),
        )
        self.queue.append(decode_req)
        return decode_req

    def kv_arrives(self, decode_req: DecodeRequest) -> None:
        """The decode manager learns the room's KV chunks all landed."""
        self.kv_manager.update_status(decode_req.req.bootstrap_room, KVPoll.Success)

    def metadata_arrives(self, decode_req: DecodeRequest, first_token: int = 7) -> None:
        """Prefill's write of the request's metadata row (MetadataBuffers.set_buf)."""
        sent = make_req(
            decode_req.req.rid, decode_req.req.bootstrap_room, len(decode_req.req.origin_input_ids)
        )
        sent.metadata_buffer_index = decode_req.metadata_buffer_index
        sent.output_ids.append(first_token)
        self.metadata_buffers.set_buf(sent)

    def tick(self) -> list[Req]:
        return self.pop_transferred()


def make_decode_kv_manager() -> CommonKVManager:
    """A decode-mode manager: plus what its receivers read."""
    mgr = _bare_kv_manager(DisaggregationMode.DECODE)
    mgr.deferred_bootstrap = None
    mgr.defer_decode_allocation = False
    mgr.addr_to_rooms_tracker = collections.defaultdict(set)
    mgr.prefill_response_tracker = {}
    mgr.required_prefill_response_num_table = {}
    mgr.connection_lock = threading.Lock()
    mgr.connection_pool = {}
    mgr.waiting_timeout = WAITING_TIMEOUT_S
    return mgr


def tick_for(target, clock: FakeClock, seconds: float, step: float = 1.0) -> list:
    """Ticks of a scheduler or transfer queue while the clock moves, `step`
    seconds before each; what the ticks returned, in order."""
    done = []
    elapsed = 0.0
    while elapsed < seconds:
        clock.advance(step)
        elapsed += step
        done += target.tick()
    return done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank_main, rank: int, port: int, results) -> None:
    try:
        clock = FakeClock()
        time.time = clock
        time.monotonic = clock
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=GROUP_TIMEOUT)
        group = dist.ProcessGroupGloo(store, rank, 2, GROUP_TIMEOUT)
        results.put((rank, None, rank_main(rank, group, clock)))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
    finally:
        # os._exit skips the queue's feeder thread: flush it first.
        results.close()
        results.join_thread()
        os._exit(0)


def run_two_ranks(rank_main) -> list:
    """rank_main(rank, group, clock) in two forked processes joined by a real
    gloo group, each with its own fake clock; what each returned, in rank order."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(rank_main, rank, port, results)) for rank in (0, 1)
    ]
    # The parent's garbage (an earlier test's event loops, sockets, gloo groups) is collected
    # here and the rest frozen: a forked rank's collector running those finalizers hung it.
    gc.collect()
    gc.freeze()
    try:
        for proc in procs:
            proc.start()
    finally:
        gc.unfreeze()
    outcomes = {}
    try:
        for _ in procs:
            rank, error, value = results.get(timeout=GROUP_TIMEOUT.total_seconds() * 2)
            assert error is None, f"rank {rank} raised:\n{error}"
            outcomes[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [outcomes[rank] for rank in (0, 1)]


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(time, "time", fake)
    monkeypatch.setattr(time, "monotonic", fake)
    return fake


@pytest.fixture
def single_rank_group() -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, GROUP_TIMEOUT)


@pytest.fixture
def scheduler(single_rank_group, clock) -> MiniPrefillScheduler:
    return MiniPrefillScheduler(single_rank_group)


@pytest.fixture
def transfer_queue(single_rank_group, clock) -> MiniDecodeTransferQueue:
    return MiniDecodeTransferQueue(single_rank_group)
