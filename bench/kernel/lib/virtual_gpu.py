"""A virtual NVIDIA device for Triton: compile and resource-check real launches without a GPU.

Triton compiles for any NVIDIA architecture without a driver (its wheel ships ptxas and
cuobjdump), and ``triton.runtime.driver.set_active`` takes any driver object. ``VirtualDriver``
reports a target's architecture and device properties and records launches instead of running
them, so our real launcher runs on CPU tensors while Triton's JIT specializes, compiles and checks
resources exactly as it would on that GPU: ``CompiledKernel._init_handles`` raises
``OutOfResources`` when the kernel needs more shared memory than the device allows per block.
Registers, local memory and instruction counts come from the cubin, read with the cuobjdump
that Triton ships.

    with virtual_device(TARGETS["rtx-pro-6000"]) as dev:
        flash_mla_sparse_decode_mma(...)      # CPU tensors
    dev.launches                               # [Launch(kernel, grid, resources), ...]
"""

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.backends.nvidia.driver import ty_to_cpp


def limits_for_arch(arch: int):
    """CUDA's per-architecture limits, from the kernel's own fit module (imported late, so a
    GPU kit can be activated first; see bench/kernel/lib/gpu_kit.py)."""
    from sglang.kernels.ops.attention.sm120_mma_fit import limits_for_arch as limits

    return limits(arch)


@dataclass(frozen=True)
class VirtualTarget:
    """One product: an architecture (whose limits come from CUDA's table) and an SM count."""

    key: str
    name: str
    arch: int
    sms: int
    # Datasheet memory bandwidth, GB/s: used only by the traffic model, labelled as such.
    datasheet_gbps: float

    @property
    def sm(self) -> str:
        return f"sm_{self.arch}"


# SM counts and bandwidths are product datasheet figures, not measurements.
TARGETS = {
    t.key: t
    for t in (
        VirtualTarget("rtx-pro-6000", "RTX PRO 6000 Blackwell", 120, 188, 1790.0),
        VirtualTarget("rtx-5090", "RTX 5090", 120, 170, 1790.0),
        VirtualTarget("dgx-spark", "DGX Spark GB10", 121, 48, 273.0),
        VirtualTarget("h200", "H200 (GPU proxy)", 90, 132, 4800.0),
    )
}


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel needs, read from its metadata and its cubin."""

    name: str
    arch: int
    num_warps: int
    shared_bytes: int
    registers: int
    local_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    tensor_core_ops: int
    block_scaled_mma: int
    global_loads: int
    global_loads_128: int
    global_loads_u8: int
    # The innermost loop that issues MMA (stage 1's tile loop), per warp and iteration: its
    # tensor-core instructions and the shared-memory bytes its loads and stores move. 0 for a
    # kernel without such a loop.
    loop_mma: int = 0
    loop_shared_read_bytes: int = 0
    loop_shared_write_bytes: int = 0

    @property
    def spills(self) -> bool:
        return bool(self.local_bytes or self.spill_stores or self.spill_loads)


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    resources: Resources
    # The launch's tl.constexpr arguments that select a compiled variant (flags and tile sizes).
    variant: tuple[tuple[str, object], ...]
    num_stages: int

    @property
    def ctas(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def _tool(name: str) -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{name} not found at {path}: this Triton wheel does not ship it")
    return path


_RESOURCE_LINE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
# SASS mnemonics: HMMA is mma.sync, HGMMA warpgroup MMA (sm_90); LDG a global load and LDGSTS an
# asynchronous global-to-shared copy (cp.async); STL/LDL local-memory stores and loads.
_TENSOR_CORE = re.compile(r"\b(?:HMMA|HGMMA|QMMA|UTCHMMA|UTCQMMA)\b")
# Block-scaled MMA (FP8/FP4 operands with UE8M0 scales applied by the tensor core): QMMA.SF.
_BLOCK_SCALED = re.compile(r"\b[A-Z]*MMA\.SF\b")
_GLOBAL_LOAD = re.compile(r"\b(LDGSTS|LDG)((?:\.\w+)*)(?=\s)")
_LOCAL = re.compile(r"\b(STL|LDL)\b")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)*0x([0-9a-f]+)")
# Shared-memory accesses and the bytes one warp-wide instruction moves: ldmatrix (LDSM) moves
# 1, 2 or 4 8x8 matrices of 16-bit values (128 B each); LDS/STS move 32 lanes x their width.
_SHARED = re.compile(r"\b(LDSM|LDS|STS)((?:\.\w+)*)(?=\s)")
_WIDTH = {".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2, ".64": 8, ".128": 16}


def _shared_bytes(op: str, suffix: str) -> int:
    if op == "LDSM":
        matrices = 4 if ".4" in suffix else 2 if ".2" in suffix else 1
        return 128 * matrices
    width = next((w for k, w in _WIDTH.items() if k in suffix), 4)
    return 32 * width


def mma_loop(sass: str) -> tuple[int, int, int]:
    """(MMA, shared bytes read, shared bytes written) per warp and iteration of the innermost
    loop that issues MMA, read from SASS: a loop is a backward branch and the instructions from
    its target to it, less what a forward branch inside it skips where that issues no MMA.
    Zeros when no loop issues MMA."""
    code = [(int(m.group(1), 16), m.group(2)) for m in _INSTRUCTION.finditer(sass)]
    loops = []
    for addr, text in code:
        branch = _BRANCH.search(text)
        if branch and int(branch.group(1), 16) < addr:
            body = [t for a, t in code if int(branch.group(1), 16) <= a <= addr]
            loops.append((int(branch.group(1), 16), addr, body))
    with_mma = [lp for lp in loops if any(_TENSOR_CORE.search(t) for t in lp[2])]
    innermost = [
        lp
        for lp in with_mma
        if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] for o in with_mma)
    ]
    if not innermost:
        return 0, 0, 0
    lo, hi, _ = innermost[0]
    # The path of an iteration over a tile with tokens: the body less what a forward branch
    # inside it skips, unless what it skips issues MMA (the tile's math, which only a tile
    # without tokens skips). An epilogue taken once per row is not a cost per tile.
    skipped = set()
    for addr, text in code:
        branch = _BRANCH.search(text)
        if branch and lo <= addr < hi and addr < int(branch.group(1), 16) <= hi:
            region = [(a, t) for a, t in code if addr < a < int(branch.group(1), 16)]
            if not any(_TENSOR_CORE.search(t) for _, t in region):
                skipped.update(a for a, _ in region)
    body = [t for a, t in code if lo <= a <= hi and a not in skipped]
    mma = sum(bool(_TENSOR_CORE.search(t)) for t in body)
    read = written = 0
    for t in body:
        for m in _SHARED.finditer(t):
            size = _shared_bytes(m.group(1), m.group(2))
            if m.group(1) == "STS":
                written += size
            else:
                read += size
    return mma, read, written


def _read_cubin(cubin: bytes) -> tuple[str, str]:
    """(resource usage, SASS) of a cubin, from one cuobjdump run that prints both (the resource
    lines name no instruction, so the SASS counts are not disturbed by them)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        both = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", "--dump-sass", f.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    return both, both


@lru_cache(maxsize=256)
def cubin_resources(name: str, arch: int, num_warps: int, shared: int, cubin: bytes) -> Resources:
    usage, sass = _read_cubin(cubin)
    match = _RESOURCE_LINE.search(usage)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource line for {name}:\n{usage}")
    regs, stack, _, local = (int(g) for g in match.groups())
    loads = [m.group(2) for m in _GLOBAL_LOAD.finditer(sass)]
    local_ops = [m.group(1) for m in _LOCAL.finditer(sass)]
    loop_mma, loop_read, loop_written = mma_loop(sass)
    return Resources(
        name=name,
        arch=arch,
        num_warps=num_warps,
        shared_bytes=shared,
        registers=regs,
        local_bytes=local,
        stack_bytes=stack,
        spill_stores=local_ops.count("STL"),
        spill_loads=local_ops.count("LDL"),
        tensor_core_ops=len(_TENSOR_CORE.findall(sass)),
        block_scaled_mma=len(_BLOCK_SCALED.findall(sass)),
        global_loads=len(loads),
        global_loads_128=sum(".128" in suffix for suffix in loads),
        global_loads_u8=sum(".U8" in suffix or ".S8" in suffix for suffix in loads),
        loop_mma=loop_mma,
        loop_shared_read_bytes=loop_read,
        loop_shared_write_bytes=loop_written,
    )


class _Utils:
    """The part of Triton's CudaUtils that the JIT and CompiledKernel use."""

    def __init__(self, device: "VirtualDriver"):
        self._device = device

    def get_device_properties(self, _device):
        limits = limits_for_arch(self._device.target.arch)
        return {
            "max_shared_mem": limits.max_shared_per_block,
            "max_num_regs": limits.regs_per_block,
            "multiprocessor_count": self._device.target.sms,
            "warpSize": 32,
            "sm_clock_rate": 0,
            "mem_clock_rate": 0,
            "mem_bus_width": 0,
        }

    def load_binary(self, name, kernel, shared, _device):
        """Instead of cuModuleLoadData: read the cubin's resources; the handle indexes them."""
        # launcher_cls runs just before load_binary in CompiledKernel._init_handles.
        num_warps = self._device._compiling[name]
        res = cubin_resources(name, self._device.target.arch, num_warps, shared, bytes(kernel))
        self._device.loaded.append(res)
        handle = len(self._device.loaded)
        limits = limits_for_arch(self._device.target.arch)
        per_warp = -(-res.registers * 32 // 256) * 256
        max_threads = min(1024, limits.regs_per_block // max(per_warp, 1) * 32)
        return handle, handle, res.registers, res.spill_stores, max_threads


def _variant(src) -> tuple[tuple[str, object], ...]:
    names = src.fn.arg_names
    flags = (
        (names[path[0]], value)
        for path, value in getattr(src, "constants", {}).items()
        if len(path) == 1 and isinstance(value, (bool, int)) and names[path[0]].isupper()
    )
    return tuple(sorted(flags))


def kernel_resources(kernel, arch: int) -> Resources:
    """Resources of a CompiledKernel from its metadata and cubin (loaded or not)."""
    meta = kernel.metadata
    return cubin_resources(kernel.name, arch, meta.num_warps, meta.shared, kernel.asm["cubin"])


class _RecordingLauncher:
    """Records each launch with the resources of the kernel it launches; runs nothing."""

    def __init__(self, device, src, metadata):
        self._device = device
        self._variant = _variant(src)
        self._num_stages = metadata.num_stages
        device._compiling[metadata.name] = metadata.num_warps

    def __call__(self, grid_x, grid_y, grid_z, _stream, function, *_args):
        res = self._device.resources_for(function)
        self._device.launches.append(
            Launch(res.name, (grid_x, grid_y, grid_z), res, self._variant, self._num_stages)
        )


class VirtualDriver(DriverBase):
    """A Triton driver for a GPU that is not there: compiles for it, records launches."""

    # Device ids far from real ones, one per target, so the JIT's per-device caches never mix
    # kernels compiled for different targets.
    _BASE_ID = 9000

    def __init__(self, target: VirtualTarget):
        self.target = target
        self.device_id = self._BASE_ID + list(TARGETS).index(target.key)
        self.utils = _Utils(self)
        self.loaded: list[Resources] = []
        self.launches: list[Launch] = []
        self._compiling: dict[str, int] = {}

    def launcher_cls(self, src, metadata):
        return _RecordingLauncher(self, src, metadata)

    def resources_for(self, function: int) -> Resources:
        return self.loaded[function - 1]

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty_to_cpp(ty)

    def get_current_target(self):
        return GPUTarget("cuda", self.target.arch, 32)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_current_device(self):
        return self.device_id

    def set_current_device(self, _device):
        pass

    def get_current_stream(self, _device=None):
        return 0

    def get_device_capability(self, _device=None):
        return divmod(self.target.arch, 10)

    def get_device_interface(self):
        raise RuntimeError("a virtual device has no torch device interface")

    def get_benchmarker(self):
        raise RuntimeError("a virtual device cannot time kernels")

    def get_empty_cache_for_benchmark(self):
        raise RuntimeError("a virtual device cannot time kernels")

    def clear_cache(self, cache):
        pass


class _RecordingUtils:
    """The real driver's utils, reading each loaded cubin's resources on the way."""

    def __init__(self, real, device: "RecordingDriver"):
        self._real = real
        self._device = device

    def __getattr__(self, name):
        return getattr(self._real, name)

    def load_binary(self, name, kernel, shared, device):
        loaded = self._real.load_binary(name, kernel, shared, device)
        num_warps = self._device._compiling[name]
        res = cubin_resources(name, self._device.arch, num_warps, shared, bytes(kernel))
        self._device.loaded_by_handle[loaded[1]] = res
        self._device.driver_registers[loaded[1]] = loaded[2]
        return loaded


class _ForwardingLauncher(_RecordingLauncher):
    """Records each launch, then launches it on the real device."""

    def __init__(self, device: "RecordingDriver", src, metadata):
        super().__init__(device, src, metadata)
        self._inner = device._real.launcher_cls(src, metadata)

    def __call__(self, grid_x, grid_y, grid_z, stream, function, *args):
        super().__call__(grid_x, grid_y, grid_z, stream, function, *args)
        return self._inner(grid_x, grid_y, grid_z, stream, function, *args)


class RecordingDriver:
    """Triton's real (CUDA) driver, launching for real while recording every launch and the
    resources of every kernel it loads, as the virtual device does: the same audit, on a GPU."""

    def __init__(self, real):
        self._real = real
        self.arch = real.get_current_target().arch
        self.device_id = real.get_current_device()
        self.utils = _RecordingUtils(real.utils, self)
        self.loaded_by_handle: dict[int, Resources] = {}
        self.driver_registers: dict[int, int] = {}
        self.launches: list[Launch] = []
        self._compiling: dict[str, int] = {}

    def __getattr__(self, name):
        return getattr(self._real, name)

    def launcher_cls(self, src, metadata):
        return _ForwardingLauncher(self, src, metadata)

    def resources_for(self, function: int) -> Resources:
        return self.loaded_by_handle[function]


@contextlib.contextmanager
def recording_device():
    """Make the real device Triton's active driver, recorded, for the block."""
    from triton.runtime.driver import driver

    previous = driver._active
    dev = RecordingDriver(driver.active)
    driver.set_active(dev)
    try:
        yield dev
    finally:
        driver._active = previous


@contextlib.contextmanager
def virtual_device(target: VirtualTarget):
    """Make ``target`` Triton's active device for the block; the previous driver comes back.

    Under TRITON_INTERPRET=1 nothing is compiled or recorded (the interpreter does not use the
    driver), but launchers that size their launch from the active device see this target: that
    is how the interpreter tests run each target's launch configuration.
    """
    from triton.runtime.driver import driver

    previous = driver._active
    dev = VirtualDriver(target)
    driver.set_active(dev)
    try:
        yield dev
    finally:
        driver._active = previous


__all__ = [
    "TARGETS",
    "Launch",
    "Resources",
    "VirtualDriver",
    "VirtualTarget",
    "RecordingDriver",
    "cubin_resources",
    "kernel_resources",
    "recording_device",
    "virtual_device",
]
