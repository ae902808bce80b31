"""CPU engines at TP > 1: patch 0026 (no PyNccl for a CPU device) and bench/dsv4_check --tp 2.

sglang 0.5.23's `init_model_parallel_group` asks for PyNccl on every device but NPU/XPU. The
torch installed here is a CUDA build whose libnccl loads, so PyNccl does not turn itself off as
it does under a CPU torch, and `PyNcclCommunicator` on a CPU device raises: without the hook a
CPU engine at TP 2 stops while it builds its groups. The first test builds sglang's real groups
in two gloo processes and shows both halves: upstream's function still asks for PyNccl, the
coordinator has none, an all-reduce goes through gloo, and PyNccl itself on the same group and
device raises (so the test cannot pass without the hook while this torch is installed).

The second runs bench/dsv4_check at TP 2 on conftest's top-k model (the c4c128 layers, 2 of 8
experts per token, the real model's kind of routing): every kernel call on every rank, the
rank's native 4 of 8 heads reaching the mma kernel (patch 0005 on the real model), logits and
greedy tokens against the TP1 run and transformers, every run taking the TP1 run's expert
choices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "dsv4_check.py"
sys.path.insert(0, str(ROOT))

from launch.pdlib.stack import free_loopback_ports  # noqa: E402

RANK = r"""
import json, sys
import torch
from sglang.srt.distributed import parallel_state as ps

asked = []
init = ps.GroupCoordinator.__init__
def spied(self, *args, **kwargs):
    asked.append(kwargs.get("use_pynccl"))
    init(self, *args, **kwargs)
ps.GroupCoordinator.__init__ = spied

method, rank = sys.argv[1], int(sys.argv[2])
ps.init_distributed_environment(
    world_size=2, rank=rank, distributed_init_method=method, local_rank=rank, backend="gloo")
tp = ps.init_model_parallel_group([[0, 1]], rank, "gloo", group_name="tp")
total = tp.all_reduce(torch.tensor([float(rank + 1)]))
try:
    from sglang.srt.distributed.device_communicators.pynccl import PyNcclCommunicator
    comm = PyNcclCommunicator(group=tp.cpu_group, device=tp.device)
    pynccl = "available" if not comm.disabled else "disabled"
except Exception as exc:
    pynccl = f"raises {type(exc).__name__}: {exc}"
print(json.dumps({"asked": asked[-1], "device": str(tp.device), "use_pynccl": tp.use_pynccl,
                  "comm": tp.pynccl_comm is None, "sum": total.item(), "pynccl": pynccl}))
# Out without the interpreter's teardown: once in CI a rank aborted there ("terminate called
# without an active exception", exit -6) after printing, which is not what this test checks.
sys.stdout.flush()
import os
os._exit(0)
"""


def test_a_cpu_tp_group_has_no_pynccl_and_all_reduces_over_gloo():
    (port,) = free_loopback_ports(1)
    method = f"tcp://127.0.0.1:{port}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, method, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    for rank in got:
        assert rank["asked"] is True  # upstream's init_model_parallel_group asks for PyNccl
        assert rank["device"] == "cpu"
        assert rank["use_pynccl"] is False and rank["comm"] is True
        assert rank["sum"] == 3.0
        # What the hook avoids: PyNccl on this CPU group, with this torch, raises.
        assert rank["pynccl"].startswith("raises"), rank["pynccl"]


def test_dsv4_check_at_tp2_equals_tp1_on_every_rank(topk_model, topk_tp2_checked):
    got = topk_tp2_checked
    assert got["tp"] == 2 and got["failures"] == []
    layers = len(json.loads((topk_model / "config.json").read_text())["compress_ratios"])
    for backend in ("mma", "torch"):
        ranks = got["ranks"][backend]
        assert [r["rank"] for r in ranks] == [0, 1]
        for r in ranks:
            assert len(r["calls"]) == layers * (got["steps"] + 1)
            assert all(not c["failed"] for c in r["calls"])
            assert r["tokens"] == got["tp1_tokens"]
    # Patch 0005 on the real model: the mma kernel gets the rank's 4 of 8 heads in every call;
    # upstream's torch backend gets its decode calls padded to 64 (its prefill calls keep 4).
    assert {c["heads"] for r in got["ranks"]["mma"] for c in r["calls"]} == {4}
    torch_heads = {c["heads"] for r in got["ranks"]["torch"] for c in r["calls"]}
    assert 64 in torch_heads and torch_heads <= {4, 64}, torch_heads
    assert "TP2-TP1 max_abs" in got["stdout"]


def test_a_dead_rank_ends_the_run_naming_it_and_leaves_no_process(swa_model):
    """Rank 1 exits before it joins the model's groups; rank 0 would block in gloo for ever."""
    # Every process of this run carries the tag in its environment (a rank inherits it), so a
    # survivor is found among all processes, and another test's checks running beside this one
    # (parallel workers) are not taken for it.
    tag = uuid.uuid4().hex
    proc = subprocess.run(
        [sys.executable, str(CHECK), "--model", str(swa_model), "--tp", "2", "--steps", "1",
         "--timeout", "120", "--kill-rank", "1"],
        capture_output=True, text=True, timeout=400, env={**os.environ, "SM120PD_TEST_TAG": tag},
    )  # fmt: skip
    assert proc.returncode == 1
    assert "TP rank 1 died (exit 3)" in proc.stderr, proc.stderr[-3000:]
    left = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("SM120PD_TEST_TAG") == tag:
                left.append((p.pid, p.cmdline()))
        except psutil.Error:
            pass  # gone, or another user's
    assert left == []


ADJUST = r"""
import copy, json, sys
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.configs.update_config import adjust_config_with_unaligned_cpu_tp

out = {}
for path in sys.argv[1:]:
    config = ModelConfig(path, trust_remote_code=True)
    for tp in (2, 3, 4):
        try:
            got = adjust_config_with_unaligned_cpu_tp(copy.deepcopy(config), LoadConfig(), tp)
            out[f"{config.hf_config.model_type} {tp}"] = [
                got.num_attention_heads, got.get_total_num_kv_heads()]
        except ValueError as exc:
            out[f"{config.hf_config.model_type} {tp}"] = str(exc)
print(json.dumps(out))
"""


def test_sglangs_cpu_tp_adjustment_keeps_dsv4s_one_kv_head_and_refuses_unaligned_heads(
    swa_model, tmp_path
):
    """Patch 0027 in sglang's own `adjust_config_with_unaligned_cpu_tp` (what ModelRunner calls
    on every CPU engine), on the tiny DSV4's config (8 query heads, one MQA KV head) and on a
    Llama config with 6 heads. MqaAttentionBase asserts one KV head, so DSV4's config must keep
    it at every TP size: at 2 and 4 the heads divide and nothing changes; at 3 they do not, and
    padding them (upstream pads the KV heads and scales the query heads to match) would give
    DSV4 more KV heads, so the engine is refused with both numbers named. The Llama model is
    still padded at TP 4 as upstream pads it (more query and KV heads than its 6, a multiple of
    4, whatever the pad size), and unchanged at TP 2 and 3."""
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 192,
                "intermediate_size": 256,
                "num_attention_heads": 6,
                "num_key_value_heads": 6,
                "num_hidden_layers": 1,
                "vocab_size": 128,
                "max_position_embeddings": 256,
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-c", ADJUST, str(swa_model), str(llama)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["deepseek_v4 2"] == [8, 1] and got["deepseek_v4 4"] == [8, 1], got
    assert got["deepseek_v4 3"].startswith(
        "DeepSeek-V4's 8 query heads do not divide by the TP size 3"
    ), got
    heads, kv = got["llama 4"]
    assert heads == kv and heads > 6 and heads % 4 == 0, got
    assert got["llama 2"] == got["llama 3"] == [6, 6], got
