"""Prefill's drain proof (patch 0030): the fence it relies on, on real NIXL agents.

Two real NIXL agents in one child process, "prefill" and "decode", UCX over TCP on loopback
(as the CPU stacks run): prefill posts a large WRITE into decode's registered memory and,
without waiting for it, the overlay's fence (an 8-byte READ of decode's memory, posted from the
same thread). The fact the proof rests on (UCX's flush semantics, as NIXL's UCX backend ends
every transfer with a flush of the posting worker's endpoint): once the fence is DONE, the
earlier WRITE is DONE too and its bytes are in decode's buffer. A fence to a peer NIXL no
longer knows cannot be made and reads as an error, never as DONE. The module is loaded by its
path: importing sglang's package would cost seconds in the child.

The real engines' test (tests/engine/test_cpu_engines.py -k post_error) covers the rest: the
fault point, the proof on the transfer worker, and decode freeing the room on the ACK.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import sglang.srt.disaggregation.nixl_drain_proof as installed

MODULE = Path(installed.__file__)

CHILD = r"""
import importlib.util, json, sys, time
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

spec = importlib.util.spec_from_file_location("nixl_drain_proof", sys.argv[1])
proof = importlib.util.module_from_spec(spec)
spec.loader.exec_module(proof)

def agent(name, threads):
    return nixl_agent(name, nixl_agent_config(
        backends=["UCX"], num_threads=threads,
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))

size = 256 << 20
prefill, decode = agent("prefill", 8), agent("decode", 0)
src = np.random.default_rng(7).integers(0, 255, size, dtype=np.uint8)
dst = np.zeros(size, dtype=np.uint8)
scratch = np.zeros(64, dtype=np.uint8)
for a, arr in ((prefill, src), (decode, dst), (prefill, scratch)):
    a.register_memory([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")
prefill.add_remote_agent(decode.get_agent_metadata())

out = {}
write = prefill.initialize_xfer(
    "WRITE",
    prefill.get_xfer_descs([(src.ctypes.data, size, 0)], "DRAM"),
    prefill.get_xfer_descs([(dst.ctypes.data, size, 0)], "DRAM"),
    "decode")
out["write_posted"] = prefill.transfer(write)
out["write_before_fence"] = prefill.check_xfer_state(write)
deadline = time.monotonic() + 60
out["fence"] = proof.fence(prefill, "decode", dst.ctypes.data, scratch.ctypes.data, deadline)
out["write_after_fence"] = prefill.check_xfer_state(write)
out["landed"] = bool((dst == src).all())
out["scratch"] = scratch[:8].tolist()
out["dst_head"] = dst[:8].tolist()
prefill.remove_remote_agent("decode")
out["fence_to_unknown_peer"] = proof.fence(
    prefill, "decode", dst.ctypes.data, scratch.ctypes.data, time.monotonic() + 10)
print(json.dumps(out))
"""


def test_a_fence_that_is_done_proves_the_earlier_write_landed():
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(MODULE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print(got)
    # The write was still in flight when the fence was posted (256 MiB over loopback TCP).
    assert got["write_posted"] == "PROC" and got["write_before_fence"] == "PROC"
    assert got["fence"] == "DONE"
    assert got["write_after_fence"] == "DONE" and got["landed"]
    # The fence read decode's first bytes, which the write had set.
    assert got["scratch"] == got["dst_head"]
    assert got["fence_to_unknown_peer"].startswith("ERR")
