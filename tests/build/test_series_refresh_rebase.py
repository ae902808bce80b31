"""refresh exports edited commits back into patches/; rebase tries the series elsewhere."""

from __future__ import annotations

import os
import subprocess

from series_fakes import EDITS, IDENTITY, NAME, TAG, UPSTREAM, edit_line, make_wheel, message

OVERLAY_FILE = "sglang/srt/sm120/knob.py"


def tree_bytes(project) -> dict[str, bytes]:
    return {
        p.relative_to(project.root).as_posix(): p.read_bytes()
        for folder in (project.patches, project.root / "overlay")
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_refresh_exports_changed_and_new_commits_with_stable_bytes(project, three_patches):
    project.series(three_patches)
    project.overlay(OVERLAY_FILE, "KNOB = 1\n")
    project.ok("build")
    label_before = project.ok("label").stdout.strip()
    first, second, third = three_patches

    # Change the last patch by amending its commit, then add a new patch on top.
    server = project.src / EDITS["server"][0]
    server.write_text(edit_line(server.read_text(), "SERVER_27 = 27\n", "SERVER_27 = 2700\n"))
    subprocess.run(
        ["git", "commit", "--quiet", "--all", "--amend", "--no-edit"],
        cwd=project.src,
        check=True,
        env={**os.environ, **IDENTITY},
    )
    init = UPSTREAM["sglang/__init__.py"]
    project.commit(
        {"sglang/__init__.py": init + "SM120 = True\n"}, message("init: mark the sm120 build")
    )

    result = project.ok("refresh")
    assert "4 patches, 1 overlay files written" in result.stdout
    names = (project.patches / "series").read_text().splitlines()
    assert names == [first, second, third, "0004-init-mark-the-sm120-build.patch"]
    after = project.patch_bytes()
    assert after[first] == three_patches[first] and after[second] == three_patches[second]
    assert after[third] != three_patches[third] and b"+SERVER_27 = 2700" in after[third]
    assert b"+SM120 = True" in after[names[3]]
    assert (project.root / "overlay" / OVERLAY_FILE).read_text() == "KNOB = 1\n"

    exported = tree_bytes(project)
    project.ok("refresh")
    assert tree_bytes(project) == exported

    check = project.ok("check")
    assert check.stdout.splitlines()[-1] == "4 patches, 1 tags: clean"
    assert project.ok("label").stdout.strip() != label_before


def test_refresh_without_a_built_tree_is_an_error(project):
    result = project.run("refresh")
    assert result.returncode == 1
    assert result.stderr.startswith("error: no tree at ") and "build/src" in result.stderr


def test_rebase_prints_a_row_per_patch_and_changes_nothing(project, three_patches):
    project.series(three_patches)
    environ, scheduler, server = (EDITS[k][0] for k in ("environ", "scheduler", "server"))
    moved = "".join(f"# new line {i}\n" for i in range(3)) + UPSTREAM[scheduler]
    changed = UPSTREAM[server].replace("SERVER_26 = 26", "SERVER_26 = 'renamed'")
    make_wheel(
        project.cache, {**UPSTREAM, scheduler: moved, server: changed}, version="0.5.24", tag=TAG
    )
    before = tree_bytes(project)

    result = project.run("rebase", "0.5.24")
    assert result.returncode == 1, result.stdout + result.stderr
    rows = result.stdout.splitlines()
    assert rows[0] == f"series on {NAME} 0.5.24 ({TAG}), pinned 0.5.23"
    first, second, third = three_patches
    table = {row.split()[0]: row.split(None, 1)[1] for row in rows[2:5]}
    assert table[first] == "applies cleanly"
    assert table[second].startswith("applies with offset: hunk #1 at ")
    assert table[second].endswith("(offset 3)")
    assert table[third].startswith(f"conflicts: {server} hunk #1")
    assert rows[-1] == "2/3 patches apply"
    assert environ in three_patches[first].decode()
    assert tree_bytes(project) == before
