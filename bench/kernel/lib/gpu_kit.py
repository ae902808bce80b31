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

The kit also carries a baseline: our kernel's files as they were at a given commit
(``BASELINE_FILES``, taken with ``git show COMMIT:PATH``, so nothing of it lives in the tree),
in ``baseline/``. ``load_baseline`` imports them side by side with the current kernel under the
package ``sm120pd_baseline``: their imports of each other by absolute name
(``sglang.kernels.ops.attention.sm120_mma_fit``...) are renamed to that package as they load,
line for line, so Triton still reads each kernel's source from the file unchanged.
"""

import hashlib
import importlib.abc
import importlib.util
import json
import re
import subprocess
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

# The baseline: our kernel's modules at a commit, as the repository holds them.
KERNEL_PACKAGE = "sglang.kernels.ops.attention"
BASELINE_SOURCE_DIR = "overlay/sglang/kernels/ops/attention"
BASELINE_FILES = ("flash_mla_sm120_mma.py", "sm120_mma_fit.py", "sm120_mma_splits.py")
BASELINE_DIR = "baseline"
BASELINE_PACKAGE = "sm120pd_baseline"
# The kernel of main when the graph-replay timing was built (issue 29 starts from it).
DEFAULT_BASELINE_COMMIT = "dc905b5"


def baseline_files(repo: Path, commit: str) -> tuple[str, dict[str, bytes]]:
    """(full commit id, {file name: bytes}) of BASELINE_FILES at ``commit`` of ``repo``."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True)

    resolved = git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if resolved.returncode != 0:
        raise ValueError(f"baseline commit {commit!r} is not a commit of {repo}")
    full = resolved.stdout.decode().strip()
    files = {}
    for name in BASELINE_FILES:
        shown = git("show", f"{full}:{BASELINE_SOURCE_DIR}/{name}")
        if shown.returncode != 0:
            raise ValueError(f"baseline commit {commit} has no {BASELINE_SOURCE_DIR}/{name}")
        files[name] = shown.stdout
    return full, files


def build_kit(
    wheel: Path, out: Path, label: str, baseline: tuple[str, dict[str, bytes]] | None = None
) -> dict:
    """Extract KIT_FILES from ``wheel`` into ``out`` (replaced), add the baseline's files
    (``baseline_files``' result) under ``baseline/`` when given, and write the manifest."""
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
    if baseline is not None:
        commit, sources = baseline
        (out / BASELINE_DIR).mkdir()
        for name, data in sources.items():
            (out / BASELINE_DIR / name).write_bytes(data)
        manifest["baseline"] = {
            "commit": commit,
            "source": BASELINE_SOURCE_DIR,
            "files": {name: hashlib.sha256(data).hexdigest() for name, data in sources.items()},
        }
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


class _RenamingLoader(importlib.abc.Loader):
    """Runs a baseline file with its sibling imports renamed to the baseline package.

    The renaming keeps every line where it was: the code object's file and line numbers are
    the file's, which is where Triton reads a kernel's source from.
    """

    def __init__(self, path: Path, siblings: list[str]):
        self.path = path
        names = "|".join(re.escape(name) for name in siblings)
        self.pattern = re.compile(rf"\b{re.escape(KERNEL_PACKAGE)}\.({names})\b")

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        text = self.pattern.sub(rf"{BASELINE_PACKAGE}.\1", self.path.read_text())
        exec(compile(text, str(self.path), "exec"), module.__dict__)


class _BaselineFinder(importlib.abc.MetaPathFinder):
    def __init__(self, directory: Path):
        self.directory = directory
        self.siblings = sorted(p.stem for p in directory.glob("*.py"))

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != BASELINE_PACKAGE or name not in self.siblings:
            return None
        file = self.directory / f"{name}.py"
        loader = _RenamingLoader(file, self.siblings)
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def load_baseline(directory: Path):
    """The baseline's ``flash_mla_sm120_mma`` module, imported from ``directory`` (a kit's
    ``baseline/``) as ``sm120pd_baseline.flash_mla_sm120_mma``, beside the current kernel.

    Its split choice reads the same knob (SGLANG_SM120_MMA_TARGET_CTAS) and logs under
    ``sm120pd_baseline.sm120_mma_splits``.
    """
    directory = Path(directory).resolve()
    if not (directory / "flash_mla_sm120_mma.py").is_file():
        raise FileNotFoundError(f"{directory} holds no baseline kernel (flash_mla_sm120_mma.py)")
    loaded = sys.modules.get(BASELINE_PACKAGE)
    if loaded is not None and loaded.__path__ != [str(directory)]:
        raise RuntimeError(f"a baseline from {loaded.__path__[0]} is already loaded")
    if loaded is None:
        package = types.ModuleType(BASELINE_PACKAGE)
        package.__path__ = [str(directory)]
        sys.modules[BASELINE_PACKAGE] = package
        sys.meta_path.insert(0, _BaselineFinder(directory))
    return importlib.import_module(f"{BASELINE_PACKAGE}.flash_mla_sm120_mma")
