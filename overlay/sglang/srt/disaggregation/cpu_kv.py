"""KV transfer from and to a CPU engine's KV pool: host memory, not device memory.

NIXL registers each KV buffer with a memory kind, and upstream's NIXL KV manager defaults every
buffer to VRAM. A CPU engine (`--device cpu`) keeps its KV pool in host memory, and UCX refuses
to register host memory as VRAM (`NIXL_ERR_BACKEND` at start-up). Patch 0007 asks this module
for the kinds once the manager has them; on any other device they stay as upstream sets them.
"""

from __future__ import annotations


def nixl_kv_mem_kinds(kinds: list[str], device: str) -> list[str]:
    """The NIXL memory kind of each KV buffer: DRAM for all of a CPU engine's, else unchanged."""
    if device == "cpu":
        return ["DRAM"] * len(kinds)
    return kinds


def nixl_state_mem_kind(device: str) -> str:
    """The NIXL memory kind of the state buffers a model's KV manager registers beside its KV
    pool (DeepSeek-V4's SWA and compressor states among them), and of their transfers:
    DRAM on a CPU engine, else VRAM as upstream has it (patch 0017)."""
    return "DRAM" if device == "cpu" else "VRAM"
