"""build and check on a clean series: the wheel's contents, reproducibility and the label."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import zipfile
from pathlib import Path

from series_fakes import EDITS, NAME, TAG, UPSTREAM, VERSION, make_wheel, sha256

OVERLAY_FILE = "sglang/srt/sm120/knob.py"


def only_wheel(project) -> Path:
    wheels = sorted(project.dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_clean_series_builds_a_wheel_with_valid_record_metadata_and_manifest(
    project, three_patches
):
    project.series(three_patches)
    project.overlay(OVERLAY_FILE, "KNOB = 1\n")
    result = project.ok("build")
    label = project.ok("label").stdout.strip()
    assert re.fullmatch(r"sm120pd\.[0-9a-f]{10}", label)
    wheel = only_wheel(project)
    assert wheel.name == f"{NAME}-{VERSION}+{label}-{TAG}.whl"
    for name in three_patches:
        assert f"clean  {name}" in result.stdout

    upstream = project.cache / f"{NAME}-{VERSION}-{TAG}.whl"
    info = f"{NAME}-{VERSION}+{label}.dist-info"
    with zipfile.ZipFile(wheel) as zf, zipfile.ZipFile(upstream) as up:
        names = set(zf.namelist())
        record = zf.read(f"{info}/RECORD").decode().splitlines()
        listed = {}
        for line in record:
            path, digest, size = line.rsplit(",", 2)
            listed[path] = (digest, size)
        assert set(listed) == names
        for path in names - {f"{info}/RECORD"}:
            data = zf.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert listed[path] == (f"sha256={expected.decode()}", str(len(data))), path
        assert listed[f"{info}/RECORD"] == ("", "")

        old_meta = up.read(f"{NAME}-{VERSION}.dist-info/METADATA").decode().splitlines()
        new_meta = zf.read(f"{info}/METADATA").decode().splitlines()
        changed = [(a, b) for a, b in zip(old_meta, new_meta, strict=True) if a != b]
        assert changed == [(f"Version: {VERSION}", f"Version: {VERSION}+{label}")]
        assert zf.read(f"{info}/WHEEL") == up.read(f"{NAME}-{VERSION}.dist-info/WHEEL")

        for rel, old, new in EDITS.values():
            assert zf.read(rel).decode() == UPSTREAM[rel].replace(old, new)
        assert zf.read(OVERLAY_FILE) == b"KNOB = 1\n"
        manifest = json.loads(zf.read(f"{info}/sm120pd_manifest.json"))

    assert manifest["label"] == label
    assert manifest["version"] == f"{VERSION}+{label}"
    assert manifest["upstream"] == {
        "name": NAME,
        "version": VERSION,
        "wheel": upstream.name,
        "sha256": sha256(upstream),
    }
    assert manifest["patches"] == [
        {"name": name, "sha256": sha256(project.patches / name)} for name in three_patches
    ]
    assert manifest["overlay"] == [
        {"path": OVERLAY_FILE, "sha256": sha256(project.root / "overlay" / OVERLAY_FILE)}
    ]


def test_check_passes_on_every_pinned_tag_and_prints_one_line_per_patch(project, three_patches):
    other = TAG.rsplit("_", 2)[0] + ("_aarch64" if TAG.endswith("x86_64") else "_x86_64")
    project.pin({TAG: project.cache / f"{NAME}-{VERSION}-{TAG}.whl",
                 other: make_wheel(project.cache, UPSTREAM, tag=other)})  # fmt: skip
    project.series(three_patches)
    result = project.ok("check")
    lines = result.stdout.splitlines()
    assert [line for line in lines if line.startswith("ok ")] == [
        f"ok   {name}" for name in three_patches
    ]
    assert f"checked {TAG}" in lines and f"checked {other}" in lines
    assert lines[-1] == "3 patches, 2 tags: clean"
    assert result.stderr == ""


def test_two_builds_from_the_same_inputs_are_byte_identical(project, three_patches):
    project.series(three_patches)
    project.overlay(OVERLAY_FILE, "KNOB = 1\n")
    project.ok("build")
    first = only_wheel(project).read_bytes()
    shutil.rmtree(project.dist)
    shutil.rmtree(project.root / "build")
    project.ok("build")
    assert only_wheel(project).read_bytes() == first
    # Rebuilding over an existing build/src must not change the bytes either.
    project.ok("build")
    assert only_wheel(project).read_bytes() == first


def test_label_changes_when_a_patch_or_an_overlay_file_changes(project, three_patches):
    project.series(three_patches)
    project.overlay(OVERLAY_FILE, "KNOB = 1\n")
    base = project.ok("label").stdout.strip()
    assert project.ok("label").stdout.strip() == base

    first = next(iter(three_patches))
    edited = three_patches[first].replace(b"Why-Patch: the", b"Why-Patch: The")
    (project.patches / first).write_bytes(edited)
    after_patch = project.ok("label").stdout.strip()
    (project.patches / first).write_bytes(three_patches[first])
    assert project.ok("label").stdout.strip() == base

    project.overlay(OVERLAY_FILE, "KNOB = 2\n")
    after_overlay = project.ok("label").stdout.strip()
    assert len({base, after_patch, after_overlay}) == 3

    project.ok("build")
    assert only_wheel(project).name == f"{NAME}-{VERSION}+{after_overlay}-{TAG}.whl"


def test_a_rebuild_with_a_new_label_replaces_the_older_wheel_of_that_tag(project, three_patches):
    project.series(three_patches)
    project.overlay(OVERLAY_FILE, "KNOB = 1\n")
    project.ok("build")
    older = only_wheel(project).name
    unrelated = project.dist / f"other-1.0-{TAG}.whl"
    unrelated.write_bytes(b"not ours")

    project.overlay(OVERLAY_FILE, "KNOB = 2\n")
    result = project.ok("build")
    label = project.ok("label").stdout.strip()
    assert f"removed {older} (older label)" in result.stdout
    ours = sorted(p.name for p in project.dist.glob(f"{NAME}-*.whl"))
    assert ours == [f"{NAME}-{VERSION}+{label}-{TAG}.whl"]
    assert unrelated.is_file()


def test_every_command_has_help(project):
    for command in ("build", "check", "refresh", "rebase", "label"):
        result = project.ok(command, "--help")
        assert result.stdout.startswith("usage: build.sh"), command
