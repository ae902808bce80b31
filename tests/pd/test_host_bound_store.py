"""Patch 0023: torch.distributed's rendezvous store listens on the init method's host only.

torch's own tcp:// rendezvous, as sglang 0.5.23 uses it for an engine's process groups, has
rank 0 host a TCPStore that listens on the wildcard address whatever host the init method
names. The installed `host_bound_store` (loaded by its path: importing sglang's distributed
package costs half a minute on two busy cores) binds it to that host. The hook in sglang's
`init_distributed_environment` is checked on the real engines: every listening socket of the
env/cpu stack is on 127.0.0.1 (tests/engine/test_cpu_engines.py).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.pdlib.stack import free_loopback_ports  # noqa: E402


def _installed_module():
    spec = importlib.util.find_spec("sglang")
    path = Path(list(spec.submodule_search_locations)[0]) / "srt/distributed/host_bound_store.py"
    assert path.is_file(), f"{path}: not in the installed sglang (rebuild the wheel)"
    module_spec = importlib.util.spec_from_file_location("host_bound_store", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


host_bound_store = _installed_module()

# Two ranks rendezvous through the store, as an engine's tensor-parallel ranks do, then sum
# their ranks over gloo.
RANK = r"""
import importlib.util, json, sys
from datetime import timedelta
import psutil, torch, torch.distributed as dist
spec = importlib.util.spec_from_file_location("host_bound_store", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
method, rank = sys.argv[2], int(sys.argv[3])
dist.init_process_group(
    "gloo", world_size=2, rank=rank,
    **module.rendezvous(method, rank, 2, timedelta(seconds=60), "gloo"))
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
port = int(method.rsplit(":", 1)[1])
listening = [c.laddr.ip for c in psutil.Process().net_connections("inet")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
print(json.dumps({"sum": total.item(), "store_listens_on": listening}))
dist.destroy_process_group()
"""


def _listening_on(port: int) -> list[str]:
    return [
        c.laddr.ip
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]


def test_rank_zero_store_listens_on_the_init_methods_host_not_on_every_interface():
    port, upstream_port = free_loopback_ports(2)
    kwargs = host_bound_store.rendezvous(
        f"tcp://127.0.0.1:{port}", 0, 1, timedelta(seconds=10), "gloo"
    )
    assert set(kwargs) == {"store"}
    store = kwargs["store"]
    store.set("room", "kept")
    assert store.get("room") == b"kept"
    assert _listening_on(port) == ["127.0.0.1"]
    # What torch's own tcp:// rendezvous does with the same kind of init method.
    torch_store, _, _ = next(
        dist.rendezvous(f"tcp://127.0.0.1:{upstream_port}?rank=0&world_size=1")
    )
    assert _listening_on(upstream_port) == ["::"]
    del store, torch_store


def test_two_gloo_ranks_rendezvous_through_the_host_bound_store():
    (port,) = free_loopback_ports(1)
    method = f"tcp://127.0.0.1:{port}"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, host_bound_store.__file__, method, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = []
    for proc in ranks:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["sum"] for r in results] == [3.0, 3.0]
    # Rank 0 hosts the store, on the host the init method names; rank 1 only connects to it.
    assert [r["store_listens_on"] for r in results] == [["127.0.0.1"], []]


@pytest.mark.parametrize(
    "method",
    ["env://", "file:///tmp/sm120pd-store", "tcp://127.0.0.1:29500?rank=0&world_size=1"],
)
def test_other_init_methods_go_to_torch_unchanged(method):
    assert host_bound_store.rendezvous(method, 0, 1, None, "gloo") == {"init_method": method}


def test_a_host_rank_zero_cannot_listen_on_is_named_with_the_init_method():
    # 192.0.2.0/24 is TEST-NET-1: no machine holds 192.0.2.123 unless it was given it.
    method = "tcp://192.0.2.123:29511"
    if any(a.address == "192.0.2.123" for addrs in psutil.net_if_addrs().values() for a in addrs):
        pytest.skip("this machine holds 192.0.2.123")
    with pytest.raises(host_bound_store.StoreListenError) as refused:
        host_bound_store.rendezvous(method, 0, 2, timedelta(seconds=5), "gloo")
    assert f"torch.distributed's rendezvous store for {method}: cannot listen on" in str(
        refused.value
    )
    assert "192.0.2.123 port 29511" in str(refused.value)
