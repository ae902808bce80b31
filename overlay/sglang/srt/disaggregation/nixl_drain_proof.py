"""Prefill proves a failed room's NIXL writes drained before it lets decode reuse the pages.

Decode frees a failed room's pages only on prefill's ABORT_ACK or once prefill is gone
(kv_quarantine). Upstream's NIXL sender sends the ACK once every handle of the room settled,
but gives up on two kinds of room and "poisons" them, never to ACK them from a live prefill
(`poison_deferred_ack_room`): a room whose post raised (the rejected request is not in the
list the worker settles, so its writes may still land) and a room whose handles were still
running NIXL_ERR_SETTLE_TIMEOUT_S after a failure. Upstream relied on decode's release timeout
for those, which patch 0024 removed, so one transport error held the room's decode pages for
the life of the prefill process.

Here the transfer worker proves the drain itself, on its own thread:
1. every handle of the batch, the rejected posts included (`note_rejected`), is polled until
   it is DONE or ERR (NIXL raises NIXL_ERR_REMOTE_DISCONNECT for a handle whose endpoint
   failed, a decode killed among them: that is ERR, `state_of` says why);
2. then a fence goes to every decode agent of the room: an 8-byte READ of that decode's
   registered aux buffer into a scratch buffer of ours. NIXL's UCX backend chooses the UCX
   worker per posting thread and ends each transfer with a flush of that worker's endpoint to
   the peer; a UCX flush completes only when every operation posted earlier on the endpoint
   completed at the target. The room's writes were posted from this thread, so the fence
   reaching DONE proves them landed. A fence that ends in ERR, or that cannot be made because
   NIXL dropped the peer (it does after a remote disconnect), means the endpoint failed, and
   UCX completes every operation of a failed endpoint: nothing more of ours goes out on it.
3. the room is then drained: the ACK goes to every decode rank that asked (now or later).

If the handles or the fences do not end within PROOF_TIMEOUT_S (past UCX's 20 s keepalive,
after which a dead peer's operations end in ERR), nothing can prove the writes stopped: the
process exits (its parent told with SIGQUIT, as sglang's scheduler does on a fatal error), so
decode's heartbeat finds the bootstrap port closed and frees the room as a gone prefill.

FAULT_ENV is a named fault point, off unless set: when it names a file that exists, the next
NIXL post of this process goes out for real and is then reported failed (the file is removed,
so it fires once per file). The tests use it; it changes nothing while unset.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

FAULT_ENV = "SM120PD_FAULT_NIXL_POST_ERROR_FILE"
PROOF_TIMEOUT_S = 30.0
POLL_S = 0.002
FENCE_BYTES = 8
# On a prefill-mode NixlKVManager: (the scratch array, its NIXL registration).
SCRATCH_ATTR = "sm120pd_fence_scratch"

_local = threading.local()


def post_fault_point() -> None:
    """Raise as a rejected post does, after the post went out, when FAULT_ENV's file exists."""
    path = os.environ.get(FAULT_ENV)
    if not path:
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        return
    logger.warning("Fault point %s: this NIXL post went out and is reported failed", FAULT_ENV)
    raise RuntimeError(f"injected post error (fault point {FAULT_ENV})")


def note_rejected(handle: Any) -> None:
    """A post of this thread raised or returned ERR: its handle may still write."""
    rejected = getattr(_local, "rejected", None)
    if rejected is None:
        rejected = _local.rejected = []
    rejected.append(handle)


def _take_rejected() -> list:
    rejected = getattr(_local, "rejected", None) or []
    _local.rejected = []
    return rejected


def prove_drained(mgr: Any, room: int, handles: list, transfer_infos: dict | None, chunk=None):
    """Return once no write of this thread for `room` can land in decode's pages (or exit the
    process). With `chunk`, the failed chunk is uncounted and the room's ACK sent if decode
    asked for it; otherwise the caller does that (upstream's settled-failure path)."""
    pending = list(handles) + _take_rejected()
    if not mgr.enable_deferred_decode_kv_release:
        mgr.poison_deferred_ack_room(room)  # decode does not wait for an ACK
        return
    started = time.monotonic()
    deadline = started + PROOF_TIMEOUT_S
    running = _settle(mgr.agent, pending, deadline)
    if running:
        _exit(room, f"{running} of its {len(pending)} NIXL handle(s) still running")
    infos = transfer_infos or {}
    peers = sorted(name for name, info in infos.items() if not getattr(info, "is_dummy", False))
    for peer in peers:
        outcome = _fence(mgr, peer, deadline)
        if outcome is None:
            _exit(room, f"the fence to decode agent {peer} still running")
        if outcome != "DONE":
            logger.warning(
                "NIXL fence for room %s to decode agent %s: %s; its endpoint failed, and UCX "
                "ends every operation of a failed endpoint",
                room,
                peer,
                outcome,
            )
    logger.warning(
        "NIXL room %s proven drained in %.3fs: %d handle(s) settled, fenced to %s; its abort "
        "is acknowledged to decode",
        room,
        time.monotonic() - started,
        len(pending),
        ", ".join(peers) or "no decode agent",
    )
    if chunk is not None:
        if chunk.staging_counted:
            chunk.staging_counted = False
            mgr._staging_outstanding[room] -= 1
        mgr._maybe_ack_drained_abort(room)


def state_of(agent: Any, handle: Any) -> str:
    """A handle's state: "DONE", "ERR" or "PROC". NIXL's binding raises, rather than answer,
    for an error its Python API has no word for. NIXL_ERR_REMOTE_DISCONNECT is the UCX
    backend's word for a request that ended on a failed endpoint (connection reset, endpoint
    timeout, not connected), or was refused because its endpoint had failed before the post:
    ended, as ERR, on the same UCX guarantee the fence rests on (every operation of a failed
    endpoint completes, and nothing more goes out on it). It is what a handle reads once the
    decode it writes to was killed, whether the write was in flight or posted after the kill.
    Any other state that cannot be read counts as running."""
    try:
        return agent.check_xfer_state(handle)
    except Exception as e:
        disconnected = type(e).__name__ == "nixlRemoteDisconnectError"
        return "ERR" if disconnected or "NIXL_ERR_REMOTE_DISCONNECT" in str(e) else "PROC"


def _settle(agent: Any, handles: list, deadline: float) -> int:
    """Poll until every handle is DONE or ERR (`state_of`); the number still running at the
    deadline."""
    while True:
        running = 0
        for handle in handles:
            if state_of(agent, handle) not in ("DONE", "ERR"):
                running += 1
        if running == 0 or time.monotonic() >= deadline:
            return running
        time.sleep(POLL_S)


def fence(agent: Any, peer: str, remote_addr: int, scratch_addr: int, deadline: float):
    """An 8-byte READ from `remote_addr` (registered by `peer`, DRAM) into our registered
    scratch, posted from this thread: "DONE", "ERR" (or why it could not be made: the
    endpoint failed), or None while still running at the deadline."""
    try:
        local = agent.get_xfer_descs([(scratch_addr, FENCE_BYTES, 0)], "DRAM")
        remote = agent.get_xfer_descs([(remote_addr, FENCE_BYTES, 0)], "DRAM")
        handle = agent.initialize_xfer("READ", local, remote, peer)
        state = agent.transfer(handle)
    except Exception as e:
        return f"ERR ({e})"
    try:
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(POLL_S)
            state = agent.check_xfer_state(handle)
        return None if state == "PROC" else state
    finally:
        if state != "PROC":
            agent.release_xfer_handle(handle)


def _fence(mgr: Any, peer: str, deadline: float):
    info = mgr.decode_kv_args_table.get(peer)
    if info is None or not info.dst_aux_ptrs:
        return "ERR (decode agent no longer registered)"
    return fence(mgr.agent, peer, info.dst_aux_ptrs[0], _scratch(mgr), deadline)


def _scratch(mgr: Any) -> int:
    """The address of this manager's fence buffer, registered with NIXL once."""
    scratch = getattr(mgr, SCRATCH_ATTR, None)
    if scratch is None:
        import numpy as np

        buffer = np.zeros(64, dtype=np.uint8)
        addr = buffer.ctypes.data
        descs = mgr.agent.register_memory([(addr, buffer.nbytes, 0, "")], "DRAM")
        scratch = (buffer, descs)
        setattr(mgr, SCRATCH_ATTR, scratch)
    return scratch[0].ctypes.data


def _exit(room: int, why: str) -> None:
    logger.critical(
        "NIXL cannot prove room %s's writes into decode's pages drained within %gs (%s): this "
        "prefill process exits, so that decode finds it gone and frees the room's pages",
        room,
        PROOF_TIMEOUT_S,
        why,
    )
    try:
        import psutil

        psutil.Process().parent().send_signal(signal.SIGQUIT)
    finally:
        os._exit(1)
