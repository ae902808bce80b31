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


def run_child(script: str) -> dict:
    """Run a child script with UCX over TCP on loopback; the JSON it prints last."""
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo")
    done = subprocess.run(
        [sys.executable, "-c", script, str(MODULE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print(got)
    return got


def test_a_fence_that_is_done_proves_the_earlier_write_landed():
    got = run_child(CHILD)
    # The write was still in flight when the fence was posted (256 MiB over loopback TCP).
    assert got["write_posted"] == "PROC" and got["write_before_fence"] == "PROC"
    assert got["fence"] == "DONE"
    assert got["write_after_fence"] == "DONE" and got["landed"]
    # The fence read decode's first bytes, which the write had set.
    assert got["scratch"] == got["dst_head"]
    assert got["fence_to_unknown_peer"].startswith("ERR")


# The decode agent in a process of its own, SIGKILLed as bench/chaos's seed 3 fault 2 killed
# decode: once while prefill's 256 MiB write to it is in flight, once before prefill posts it
# (prefill was stopped then, and resumed after the kill).
CHILD_KILLED_PEER = r"""
import base64, importlib.util, json, signal, subprocess, sys, time
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

spec = importlib.util.spec_from_file_location("nixl_drain_proof", sys.argv[1])
proof = importlib.util.module_from_spec(spec)
spec.loader.exec_module(proof)

DECODE = '''
import base64, time, numpy as np
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
a = nixl_agent("decode", nixl_agent_config(backends=["UCX"], num_threads=0,
    sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
dst = np.zeros(256 << 20, dtype=np.uint8)
a.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
print("META", base64.b64encode(a.get_agent_metadata()).decode(), dst.ctypes.data, flush=True)
time.sleep(300)
'''
size = 256 << 20
prefill = nixl_agent("prefill", nixl_agent_config(backends=["UCX"], num_threads=8,
    sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
src = np.ones(size, dtype=np.uint8)
scratch = np.zeros(64, dtype=np.uint8)
for arr in (src, scratch):
    prefill.register_memory([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")
out = {}
for when in ("in flight", "before the post"):
    decode = subprocess.Popen([sys.executable, "-c", DECODE], stdout=subprocess.PIPE, text=True)
    line = decode.stdout.readline()
    while not line.startswith("META"):
        line = decode.stdout.readline()
    _, meta, addr = line.split()
    addr = int(addr)
    prefill.add_remote_agent(base64.b64decode(meta))
    def write(n):
        return prefill.initialize_xfer(
            "WRITE",
            prefill.get_xfer_descs([(src.ctypes.data, n, 0)], "DRAM"),
            prefill.get_xfer_descs([(addr, n, 0)], "DRAM"),
            "decode")
    small = write(8)
    state = prefill.transfer(small)
    while state == "PROC":
        state = prefill.check_xfer_state(small)
    got = out[when] = {"connected": state}
    handle = write(size)
    if when == "in flight":
        got["posted"] = prefill.transfer(handle)
        decode.send_signal(signal.SIGKILL)
        decode.wait()
    else:
        decode.send_signal(signal.SIGKILL)
        decode.wait()
        time.sleep(1)
        try:
            got["posted"] = prefill.transfer(handle)
        except Exception as e:
            got["posted"] = f"raised {type(e).__name__}"
    started = time.monotonic()
    got["running"] = proof._settle(prefill, [handle], started + 10)
    got["settle_s"] = round(time.monotonic() - started, 3)
    got["state"] = proof.state_of(prefill, handle)
    got["fence"] = proof.fence(prefill, "decode", addr, scratch.ctypes.data, time.monotonic() + 10)
    prefill.remove_remote_agent("decode")
print(json.dumps(out))
"""


def test_a_handle_to_a_killed_decode_settles_as_an_error_at_once():
    """A write to a decode agent whose process was killed reads NIXL_ERR_REMOTE_DISCONNECT,
    which NIXL's binding raises instead of answering "ERR": the proof takes it as ended (its
    endpoint failed), both for a write in flight at the kill and for one posted after it, and
    the fence to that decode fails too. Read as running, it held the proof for its 30 s and
    then ended the prefill process (bench/chaos seed 3, fault 2)."""
    got = run_child(CHILD_KILLED_PEER)
    flight, before = got["in flight"], got["before the post"]
    assert flight["connected"] == before["connected"] == "DONE"
    assert flight["posted"] == "PROC"
    assert before["posted"] == "raised nixlRemoteDisconnectError"
    for case in (flight, before):
        assert case["running"] == 0 and case["settle_s"] < 5, case
        assert case["state"] == "ERR" and case["fence"].startswith("ERR"), case
