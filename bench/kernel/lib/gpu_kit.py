"""The GPU kit: our decode kernel and upstream's SM120 dispatch, importable without sglang.

A lent GPU machine has torch and triton but few of sglang's dependencies (no pydantic, pyzmq,
fastapi, ...) and no package registry. Importing ``sglang.kernels.ops.attention`` through the
installed package pulls all of them in (``sglang/__init__``, ``sglang.kernels`` registries,
``sglang.srt.utils``). The kernel path itself needs far less: our overlay modules import only
torch, triton and each other, and upstream's ``flash_mla_sm120.py`` (the patched dispatch, with
the torch reference the checks compare against) needs ``sglang.srt.environ`` (standard library
only) and ``is_hip`` from ``sglang.srt.utils``.

``build_kit`` copies exactly those files out of our patched wheel into a folder that mirrors the
wheel's paths, with a manifest (the wheel, its series label, each file's sha256).
``activate`` makes them importable under their real names: it registers the package levels as
empty namespace packages whose ``__path__`` is the kit's folders, so no package ``__init__`` of
sglang runs, and it provides ``sglang.srt.utils`` as a module holding upstream's ``is_hip`` rule
(``torch.version.hip is not None``), the one name the dispatch imports from it.
"""

import hashlib
import json
import sys
import types
import zipfile
from pathlib import Path

# Wheel paths of the files the kernel path imports (upstream's, patched, and our overlay's).
KIT_FILES = (
    "sglang/kernels/ops/attention/flash_mla_sm120.py",
    "sglang/kernels/ops/attention/flash_mla_sm120_triton.py",
    "sglang/kernels/ops/attention/flash_mla_sm120_mma.py",
    "sglang/kernels/ops/attention/sm120_mma_splits.py",
    "sglang/kernels/ops/attention/sm120_mma_fit.py",
    "sglang/kernels/ops/attention/sm120_mma_heads.py",
    "sglang/srt/environ.py",
)
_PACKAGES = (
    "sglang",
    "sglang.kernels",
    "sglang.kernels.ops",
    "sglang.kernels.ops.attention",
    "sglang.srt",
)
MANIFEST = "kit_manifest.json"


def build_kit(wheel: Path, out: Path, label: str) -> dict:
    """Extract KIT_FILES from ``wheel`` into ``out`` (replaced) and write the manifest."""
    if out.exists():
        for path in sorted(out.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        missing = [name for name in KIT_FILES if name not in names]
        if missing:
            raise FileNotFoundError(f"{wheel.name} lacks {', '.join(missing)}")
        for name in KIT_FILES:
            data = zf.read(name)
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            files[name] = hashlib.sha256(data).hexdigest()
    manifest = {"wheel": wheel.name, "label": label, "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def kit_bytes(kit: Path) -> int:
    return sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())


def _is_hip() -> bool:
    import torch

    return torch.version.hip is not None


def activate(kit: Path) -> dict:
    """Make the kit's modules importable under their sglang names; returns its manifest.

    Refuses when sglang is already imported in this process (the two would mix).
    """
    kit = Path(kit).resolve()
    manifest_path = kit / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{kit} is not a GPU kit (no {MANIFEST}); run --prepare")
    loaded = sorted(name for name in sys.modules if name == "sglang" or name.startswith("sglang."))
    if loaded and getattr(sys.modules["sglang"], "__kit__", None) != str(kit):
        raise RuntimeError(f"sglang is already imported ({loaded[0]}); activate the kit first")
    for name in _PACKAGES:
        if name in sys.modules:
            continue
        package = types.ModuleType(name)
        package.__path__ = [str(kit / name.replace(".", "/"))]
        package.__kit__ = str(kit)
        sys.modules[name] = package
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, package)
    if "sglang.srt.utils" not in sys.modules:
        utils = types.ModuleType("sglang.srt.utils")
        utils.is_hip = _is_hip
        sys.modules["sglang.srt.utils"] = utils
        sys.modules["sglang.srt"].utils = utils
    return json.loads(manifest_path.read_text())
