"""The patch-series pipeline behind ./build.sh.

Pinned upstream wheel -> git tree with an "upstream" commit -> our overlay files as an "overlay"
commit -> our patches applied with `git am` -> repacked wheel with a local version label and a
manifest. Also checks the series (clean apply on every pinned tag, headers, staleness), exports
edited commits back into patches/, and tries the series on other upstream releases.

Runs with the standard library plus pypa `wheel` (for `wheel unpack` / `wheel pack`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

PROJECT = "sm120pd"
MANIFEST_NAME = f"{PROJECT}_manifest.json"
# Fixed identity and time for every commit we make, so commit ids, exported patches and wheel
# timestamps do not depend on who builds or when.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "sm120pd build",
    "GIT_AUTHOR_EMAIL": "build@sm120pd.invalid",
    "GIT_COMMITTER_NAME": "sm120pd build",
    "GIT_COMMITTER_EMAIL": "build@sm120pd.invalid",
}
FIXED_DATE = "2000-01-01T00:00:00+00:00"
FIXED_RFC2822 = "Sat, 1 Jan 2000 00:00:00 +0000"
SOURCE_DATE_EPOCH = "946684800"
HEADER_FIELDS = ("Why-Patch", "Upstream-Status", "Tests")
UPSTREAM_STATUSES = ("forwarded", "not-needed", "upstreamable")
PLATFORMS = ("x86_64", "aarch64")


class SeriesError(Exception):
    """A problem with the inputs that stops the pipeline; printed as one line."""


@dataclass(frozen=True)
class Paths:
    root: Path
    cache: Path
    build: Path
    dist: Path

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def overlay(self) -> Path:
        return self.root / "overlay"

    @property
    def src(self) -> Path:
        return self.build / "src"


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    wheels: dict[str, str]  # tag -> sha256

    @staticmethod
    def load(patches: Path) -> Pin:
        path = patches / "upstream.toml"
        if not path.is_file():
            raise SeriesError(f"missing upstream pin {path}")
        data = tomllib.loads(path.read_text())
        try:
            up = data["upstream"]
            return Pin(up["name"], up["version"], dict(data["wheels"]))
        except KeyError as e:
            raise SeriesError(f"{path}: missing key {e}") from None

    def wheel_name(self, tag: str) -> str:
        return f"{self.name}-{self.version}-{tag}.whl"


def tag_for(python: str, platform: str) -> str:
    if python not in ("3.11", "3.12", "3.13"):
        raise SeriesError(f"unsupported --python {python!r}: use 3.11, 3.12 or 3.13")
    if platform not in PLATFORMS:
        raise SeriesError(f"unsupported --platform {platform!r}: use x86_64 or aarch64")
    cp = "cp" + python.replace(".", "")
    return f"{cp}-{cp}-manylinux_2_34_{platform}"


def host_tag() -> str:
    machine = os.uname().machine
    return tag_for(f"{sys.version_info.major}.{sys.version_info.minor}", machine)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run(cmd: list[str], cwd: Path | None = None, check: bool = True, **kw):
    env = {**os.environ, **GIT_IDENTITY, "GIT_AUTHOR_DATE": FIXED_DATE}
    env.setdefault("GIT_COMMITTER_DATE", FIXED_DATE)
    env.update(kw.pop("env", {}))
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, **kw)
    if check and result.returncode != 0:
        raise SeriesError(f"{' '.join(cmd[:3])} failed: {(result.stderr or result.stdout).strip()}")
    return result


def git(src: Path, *args: str, check: bool = True, **kw):
    return run(["git", "-c", "core.compression=1", *args], cwd=src, check=check, **kw)


# ---- series inputs ------------------------------------------------------------------------


def series_patches(paths: Paths) -> list[Path]:
    """Patches in series order, as listed in patches/series."""
    series = paths.patches / "series"
    if not series.is_file():
        raise SeriesError(f"missing series file {series}")
    names = [
        line.strip()
        for line in series.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    missing = [n for n in names if not (paths.patches / n).is_file()]
    if missing:
        raise SeriesError(f"patches/series lists missing patch {missing[0]}")
    unlisted = sorted(p.name for p in paths.patches.glob("*.patch") if p.name not in set(names))
    if unlisted:
        raise SeriesError(f"patch {unlisted[0]} is not listed in patches/series")
    return [paths.patches / n for n in names]


def overlay_files(paths: Paths) -> list[Path]:
    if not paths.overlay.is_dir():
        return []
    return sorted(
        p.relative_to(paths.overlay)
        for p in paths.overlay.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def series_label(paths: Paths) -> str:
    """PEP 440 local label that changes whenever the pin, a patch or an overlay file changes."""
    digest = hashlib.sha256()
    digest.update((paths.patches / "upstream.toml").read_bytes())
    for patch in series_patches(paths):
        digest.update(b"patch\0" + patch.name.encode() + b"\0" + patch.read_bytes())
    for rel in overlay_files(paths):
        data = (paths.overlay / rel).read_bytes()
        digest.update(b"overlay\0" + rel.as_posix().encode() + b"\0" + data)
    return f"{PROJECT}.{digest.hexdigest()[:10]}"


def read_header(patch: Path) -> dict[str, str]:
    """The fixed fields of a patch message (before the first diff)."""
    message = patch.read_text().split("\n---\n", 1)[0]
    fields = {}
    for line in message.splitlines():
        m = re.match(r"^([A-Z][A-Za-z-]+):\s*(.*)$", line)
        if m and m.group(1) in HEADER_FIELDS:
            fields[m.group(1)] = m.group(2).strip()
    return fields


def header_problem(paths: Paths, patch: Path) -> str | None:
    fields = read_header(patch)
    for name in HEADER_FIELDS:
        if not fields.get(name):
            return f"header field {name}: missing or empty"
    status = fields["Upstream-Status"].split()[0].lower()
    if status not in UPSTREAM_STATUSES:
        return f"Upstream-Status {status!r} is not one of {', '.join(UPSTREAM_STATUSES)}"
    for ref in re.split(r"[,\s]+", fields["Tests"]):
        test_file = ref.split("::")[0]
        if test_file.startswith("tests/") and not (paths.root / test_file).exists():
            return f"Tests names {test_file}, which does not exist"
    return None


# ---- upstream wheels ----------------------------------------------------------------------


def fetch(paths: Paths, pin: Pin, tag: str) -> Path:
    """The pinned upstream wheel for tag, from the cache or downloaded into it, sha256-checked."""
    if tag not in pin.wheels:
        raise SeriesError(f"tag {tag} is not pinned in patches/upstream.toml")
    wheel = paths.cache / pin.wheel_name(tag)
    if not wheel.is_file():
        download(paths.cache, pin.name, pin.version, tag)
    actual = sha256_of(wheel)
    if actual != pin.wheels[tag]:
        bad = wheel.with_suffix(".whl.rejected")
        wheel.replace(bad)
        raise SeriesError(
            f"sha256 mismatch for {wheel.name}: pinned {pin.wheels[tag]}, got {actual} "
            f"(moved aside to {bad.name}; nothing built)"
        )
    return wheel


def download(cache: Path, name: str, version: str, tag: str) -> None:
    py, abi, plat = tag.split("-")
    cache.mkdir(parents=True, exist_ok=True)
    print(f"fetching {name}=={version} ({tag})", flush=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--implementation", "cp", "--python-version", py[2:],
        "--abi", abi, "--platform", plat, "--dest", str(cache), f"{name}=={version}",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:]
        raise SeriesError(f"could not download {name}=={version} for {tag}: {' '.join(tail)}")


# ---- the tree -----------------------------------------------------------------------------


def unpack_upstream(wheel: Path, src: Path, only: set[str] | None = None) -> None:
    """src becomes a git repo whose single commit "upstream" is the unpacked wheel.

    With only, just those files are unpacked: enough to apply and export the series exactly
    (patch application and --full-index blob ids depend only on the files a patch touches), at
    a fraction of the cost of committing the whole wheel for every pinned tag.
    """
    if src.exists():
        shutil.rmtree(src)
    src.parent.mkdir(parents=True, exist_ok=True)
    if only is None:
        with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
            run([sys.executable, "-m", "wheel", "unpack", "--dest", tmp, str(wheel)])
            (unpacked,) = Path(tmp).iterdir()
            unpacked.rename(src)
    else:
        src.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            for name in sorted(only & set(zf.namelist())):
                zf.extract(name, src)
    git(src, "init", "--quiet", "--initial-branch=series")
    git(src, "add", "--all", "--force")
    git(src, "commit", "--quiet", "--no-verify", "--allow-empty", "--message", "upstream")
    git(src, "tag", "upstream")


def upstream_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def touched_files(patches: list[Path]) -> set[str]:
    names = set()
    for patch in patches:
        names |= set(re.findall(r"^diff --git a/(\S+) b/", patch.read_text(), flags=re.M))
    return names


def lay_overlay(paths: Paths, src: Path, upstream: set[str]) -> None:
    for rel in overlay_files(paths):
        target = src / rel
        if rel.as_posix() in upstream:
            raise SeriesError(
                f"overlay/{rel.as_posix()} collides with an upstream file: overlay only adds "
                "files; change upstream files with a patch"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(paths.overlay / rel, target)
    git(src, "add", "--all", "--force")
    git(src, "commit", "--quiet", "--no-verify", "--allow-empty", "--message", "overlay")
    git(src, "tag", "overlay")


@dataclass
class Applied:
    patch: str
    outcome: str  # "clean", "offset", "fuzz" or "conflict"
    detail: str = ""


def apply_patch(src: Path, patch: Path) -> Applied:
    """Apply one patch as a commit; report whether it needed offsets or did not apply.

    git apply never fuzzes context, but it silently accepts hunks found at an offset; its
    verbose output is the only place that says so.
    """
    probe = git(src, "apply", "--check", "--verbose", str(patch), check=False)
    output = probe.stdout + probe.stderr
    if probe.returncode != 0:
        failed = re.search(r"error: patch failed: (\S+):(\d+)", output)
        missing = re.search(r"error: (\S+): (does not exist in index|No such file)", output)
        if failed:
            hunk = hunk_at(patch, failed.group(1), int(failed.group(2)))
            detail = f"{failed.group(1)} hunk #{hunk} (@@ -{failed.group(2)})"
        elif missing:
            detail = f"{missing.group(1)} does not exist upstream"
        else:
            detail = output.strip().splitlines()[-1] if output.strip() else "git apply failed"
        return Applied(patch.name, "conflict", detail)
    offsets = re.findall(r"Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)", output)
    am = git(src, "am", "--quiet", "--committer-date-is-author-date", str(patch), check=False)
    if am.returncode != 0:
        git(src, "am", "--abort", check=False)
        return Applied(patch.name, "conflict", (am.stderr or am.stdout).strip().splitlines()[0])
    if offsets:
        where = ", ".join(f"hunk #{h} at {at} (offset {off})" for h, at, off in offsets)
        return Applied(patch.name, "offset", where)
    return Applied(patch.name, "clean")


def hunk_at(patch: Path, path: str, line: int) -> int:
    """The 1-based number, within its file, of the hunk of patch that starts at line."""
    current, number = None, 0
    for text in patch.read_text().splitlines():
        if text.startswith("+++ "):
            current, number = text[6:] if text.startswith("+++ b/") else text[4:], 0
        elif text.startswith("@@ ") and current == path:
            number += 1
            if int(re.match(r"@@ -(\d+)", text).group(1)) == line:
                return number
    return number


def apply_series(paths: Paths, src: Path, strict: bool) -> list[Applied]:
    results = []
    for patch in series_patches(paths):
        applied = apply_patch(src, patch)
        results.append(applied)
        if applied.outcome == "conflict":
            raise SeriesError(f"{patch.name} does not apply: {applied.detail}")
        if strict and applied.outcome != "clean":
            raise SeriesError(f"{patch.name} applies only with {applied.detail}; refresh it")
    return results


def prepare_tree(paths: Paths, pin: Pin, tag: str, src: Path, strict: bool) -> list[Applied]:
    wheel = fetch(paths, pin, tag)
    unpack_upstream(wheel, src)
    lay_overlay(paths, src, upstream_files(wheel))
    return apply_series(paths, src, strict)


def export_patches(src: Path, dest: Path) -> list[Path]:
    """Commits after "overlay" as format-patch files with stable bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    git(
        src, "format-patch", "--quiet", "--no-signature", "--zero-commit", "--full-index",
        "--no-stat", "--no-numbered", "--subject-prefix=PATCH", "--output-directory",
        str(dest), "overlay..HEAD",
    )  # fmt: skip
    exported = sorted(dest.glob("*.patch"))
    for patch in exported:
        text = patch.read_text()
        patch.write_text(re.sub(r"^Date: .*$", f"Date: {FIXED_RFC2822}", text, count=1, flags=re.M))
    return exported


# ---- wheel --------------------------------------------------------------------------------


def repack(paths: Paths, pin: Pin, tag: str, src: Path, label: str) -> Path:
    """Pack the patched tree as <name>-<version>+<label>, with a manifest; returns the wheel."""
    version = f"{pin.version}+{label}"
    paths.dist.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=paths.build) as tmp:
        stage = Path(tmp) / "stage"
        stage.mkdir()
        archive = Path(tmp) / "tree.tar"
        git(src, "archive", "--format=tar", f"--output={archive}", "HEAD")
        run(["tar", "-x", "-f", str(archive), "-C", str(stage)])
        old_info = stage / f"{pin.name}-{pin.version}.dist-info"
        new_info = stage / f"{pin.name}-{version}.dist-info"
        old_info.rename(new_info)
        set_version(new_info / "METADATA", version)
        (new_info / MANIFEST_NAME).write_text(
            json.dumps(manifest(paths, pin, tag, label), indent=2, sort_keys=True) + "\n"
        )
        normalise_modes(stage)
        env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}
        packed = mkdir(Path(tmp) / "packed")
        run([sys.executable, "-m", "wheel", "pack", "--dest-dir", str(packed), str(stage)], env=env)
        name = f"{pin.name}-{version}-{tag}.whl"
        if not (packed / name).is_file():
            raise SeriesError(f"wheel pack did not produce {name}")
        # Moved into dist/ only when complete, so a failed build leaves no partial wheel.
        (packed / name).replace(paths.dist / name)
    # One wheel per tag: an older label beside it makes `pip install dist/*.whl` unresolvable.
    for stale in paths.dist.glob(f"{pin.name}-{pin.version}+*-{tag}.whl"):
        if stale.name != name:
            stale.unlink()
            print(f"[{tag}] removed {stale.name} (older label)", flush=True)
    return paths.dist / name


def set_version(metadata: Path, version: str) -> None:
    """Replace the Version header in place; every other byte of METADATA stays upstream's."""
    text = metadata.read_text()
    new, count = re.subn(r"^Version: .*$", f"Version: {version}", text, count=1, flags=re.M)
    if count != 1:
        raise SeriesError(f"{metadata} has no Version header")
    metadata.write_text(new)


def normalise_modes(stage: Path) -> None:
    for path in stage.rglob("*"):
        if path.is_file():
            path.chmod(0o755 if path.stat().st_mode & 0o111 else 0o644)


def manifest(paths: Paths, pin: Pin, tag: str, label: str) -> dict:
    return {
        "project": PROJECT,
        "label": label,
        "version": f"{pin.version}+{label}",
        "tag": tag,
        "upstream": {
            "name": pin.name,
            "version": pin.version,
            "wheel": pin.wheel_name(tag),
            "sha256": pin.wheels[tag],
        },
        "patches": [{"name": p.name, "sha256": sha256_of(p)} for p in series_patches(paths)],
        "overlay": [
            {"path": rel.as_posix(), "sha256": sha256_of(paths.overlay / rel)}
            for rel in overlay_files(paths)
        ],
    }


# ---- commands -----------------------------------------------------------------------------


def cmd_build(paths: Paths, args) -> int:
    pin = Pin.load(paths.patches)
    tags = list(pin.wheels) if args.all else [tag_for(args.python, args.platform)]
    label = series_label(paths)
    for tag in tags:  # every wheel is verified before anything is built
        fetch(paths, pin, tag)
    for tag in tags:
        print(f"[{tag}] upstream {pin.name} {pin.version}", flush=True)
        results = prepare_tree(paths, pin, tag, paths.src, strict=False)
        for applied in results:
            note = f" ({applied.detail})" if applied.detail else ""
            print(f"[{tag}] {applied.outcome:<6} {applied.patch}{note}", flush=True)
        wheel = repack(paths, pin, tag, paths.src, label)
        print(f"[{tag}] built {wheel}", flush=True)
    return 0


def cmd_check(paths: Paths, args) -> int:
    pin = Pin.load(paths.patches)
    patches = series_patches(paths)
    problems = []
    for patch in patches:
        problem = header_problem(paths, patch)
        if problem:
            problems.append(f"{patch.name}: {problem}")
    outcomes: dict[str, list[str]] = {p.name: [] for p in patches}
    stale: set[str] = set()
    untried: dict[str, list[str]] = {p.name: [] for p in patches}
    for tag in pin.wheels:
        with tempfile.TemporaryDirectory(dir=mkdir(paths.build)) as tmp:
            src = Path(tmp) / "src"
            wheel = fetch(paths, pin, tag)
            unpack_upstream(wheel, src, only=touched_files(patches))
            lay_overlay(paths, src, upstream_files(wheel))
            for index, patch in enumerate(patches):
                applied = apply_patch(src, patch)
                if applied.outcome != "clean":
                    outcomes[patch.name].append(f"{tag}: {applied.outcome} {applied.detail}")
                if applied.outcome == "conflict":
                    for later in patches[index + 1 :]:
                        untried[later.name].append(tag)
                    break
            else:
                exported = export_patches(src, Path(tmp) / "export")
                stale |= stale_files(patches, exported)
        print(f"checked {tag}", flush=True)
    for patch in patches:
        bad = outcomes[patch.name]
        if bad:
            problems.append(f"{patch.name}: {bad[0]}")
        if patch.name in stale:
            problems.append(f"{patch.name}: stale, exporting the tree changes it (run refresh)")
        if bad or patch.name in stale or header_problem(paths, patch):
            status = "FAIL"
        elif untried[patch.name]:
            status = "----"  # not applied: an earlier patch conflicts
        else:
            status = "ok"
        note = f" (not tried on {len(untried[patch.name])} tags)" if untried[patch.name] else ""
        print(f"{status:<4} {patch.name}{note}")
    for name in sorted(stale - set(outcomes)):
        problems.append(f"{name}: the tree exports a patch the series lacks (run refresh)")
    if not patches:
        print("(the series has no patches)")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    print(f"{len(patches)} patches, {len(pin.wheels)} tags: {'FAILED' if problems else 'clean'}")
    return 1 if problems else 0


def stale_files(patches: list[Path], exported: list[Path]) -> set[str]:
    ours = {p.name: p.read_bytes() for p in patches}
    theirs = {p.name: p.read_bytes() for p in exported}
    return {name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name)}


def cmd_refresh(paths: Paths, args) -> int:
    src = paths.src
    if not (src / ".git").is_dir():
        raise SeriesError(f"no tree at {src}: run ./build.sh first")
    for tag in ("upstream", "overlay"):
        if git(src, "rev-parse", "--verify", "--quiet", tag, check=False).returncode != 0:
            raise SeriesError(f"{src} has no {tag!r} tag: rebuild it with ./build.sh")
    if git(src, "status", "--porcelain").stdout.strip():
        raise SeriesError(f"{src} has uncommitted changes: commit them first")
    with tempfile.TemporaryDirectory(dir=paths.build) as tmp:
        exported = export_patches(src, Path(tmp))
        for old in paths.patches.glob("*.patch"):
            old.unlink()
        for patch in exported:
            shutil.copyfile(patch, paths.patches / patch.name)
    (paths.patches / "series").write_text("".join(f"{p.name}\n" for p in exported))
    added = git(src, "diff", "--name-only", "--diff-filter=AM", "upstream", "overlay").stdout
    if paths.overlay.exists():
        shutil.rmtree(paths.overlay)
    for rel in added.split():
        target = paths.overlay / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, target)
    for patch in exported:
        print(f"exported {patch.name}")
    print(f"{len(exported)} patches, {len(added.split())} overlay files written")
    return 0


def cmd_rebase(paths: Paths, args) -> int:
    """Try the series on another upstream release; changes nothing in patches/."""
    version = args.version
    pin = Pin.load(paths.patches)
    tag = tag_for(args.python, args.platform)
    cache = paths.cache
    wheel = cache / f"{pin.name}-{version}-{tag}.whl"
    if not wheel.is_file():
        download(cache, pin.name, version, tag)
    if not wheel.is_file():
        raise SeriesError(f"no wheel {wheel.name} for {pin.name}=={version}")
    rows = []
    with tempfile.TemporaryDirectory(dir=mkdir(paths.build)) as tmp:
        src = Path(tmp) / "src"
        patches = series_patches(paths)
        unpack_upstream(wheel, src, only=touched_files(patches))
        lay_overlay(paths, src, upstream_files(wheel))
        for patch in patches:
            applied = apply_patch(src, patch)
            rows.append(applied)
    width = max([len(r.patch) for r in rows] + [5])
    print(f"series on {pin.name} {version} ({tag}), pinned {pin.version}")
    print(f"{'patch':<{width}}  result")
    labels = {"clean": "applies cleanly", "offset": "applies with offset", "conflict": "conflicts"}
    for r in rows:
        detail = f": {r.detail}" if r.detail else ""
        print(f"{r.patch:<{width}}  {labels[r.outcome]}{detail}")
    conflicts = sum(r.outcome == "conflict" for r in rows)
    print(f"{len(rows) - conflicts}/{len(rows)} patches apply")
    return 1 if conflicts else 0


def cmd_label(paths: Paths, args) -> int:
    Pin.load(paths.patches)  # a missing or broken pin is a one-line error, not a traceback
    print(series_label(paths))
    return 0


def mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def parse_args(argv: list[str]) -> argparse.Namespace:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    parser = argparse.ArgumentParser(prog="build.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command")

    def tag_options(p):
        p.add_argument("--python", default=py, help=f"3.11, 3.12 or 3.13 (default {py})")
        p.add_argument(
            "--platform",
            default=os.uname().machine,
            help=f"x86_64 or aarch64 (default {os.uname().machine})",
        )

    b = sub.add_parser("build", help="build the patched wheel into dist/ (the default)")
    tag_options(b)
    b.add_argument("--all", action="store_true", help="build every pinned tag")
    sub.add_parser("check", help="apply the series on every pinned tag; fail on any problem")
    sub.add_parser("refresh", help="export build/src commits after 'overlay' into patches/")
    r = sub.add_parser("rebase", help="try the series on another upstream release")
    r.add_argument("version", help="upstream release, e.g. 0.5.24")
    tag_options(r)
    sub.add_parser("label", help="print the local version label of this series")
    commands = ("build", "check", "refresh", "rebase", "label")
    # The command defaults to build; --root (used by the tests) may come before it.
    lead = 2 if argv[:1] == ["--root"] else 1 if argv[:1] and argv[0].startswith("--root=") else 0
    rest = argv[lead:]
    if not rest or (rest[0] not in commands and rest[0] not in ("-h", "--help")):
        argv = [*argv[:lead], "build", *rest]
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tools.entry import require

    # Its one dependency comes from build/tools-venv, which ./build.sh sets up.
    require(
        "tools/series.py",
        "wheel",
        fix="run it through ./build.sh (it sets up build/tools-venv with the pinned wheel)",
    )
    root = args.root.resolve()
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    paths = Paths(
        root=root,
        cache=Path(os.environ.get("SM120PD_CACHE") or cache_home / PROJECT / "upstream"),
        build=root / "build",
        dist=root / "dist",
    )
    commands = {
        "build": cmd_build,
        "check": cmd_check,
        "refresh": cmd_refresh,
        "rebase": cmd_rebase,
        "label": cmd_label,
    }
    try:
        return commands[args.command](paths, args)
    except SeriesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
