"""Each broken input stops the pipeline with exit 1 and one error line naming the culprit."""

from __future__ import annotations

import pytest
from series_fakes import (
    EDITS,
    NAME,
    TAG,
    UPSTREAM,
    VERSION,
    make_wheel,
    message,
    new_project,
    series_from_commits,
    sha256,
)


def moved_down(text: str, lines: int = 4) -> str:
    return "".join(f"# inserted {i}\n" for i in range(lines)) + text


def repin(project, files: dict[str, str]) -> None:
    """Pin a different upstream 0.5.23 than the one the patches were made against."""
    project.cache.joinpath(f"{NAME}-{VERSION}-{TAG}.whl").unlink()
    project.pin({TAG: make_wheel(project.cache, files)})


def name_of(patches: dict[str, bytes], key: str) -> str:
    (name,) = [n for n in patches if key in n]
    return name


def only_error(result) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_conflicting_patch_fails_build_and_check_naming_the_patch_and_file(project, three_patches):
    rel = EDITS["scheduler"][0]
    repin(project, {**UPSTREAM, rel: UPSTREAM[rel].replace("SCHED_24 = 24", "SCHED_24 = -1")})
    project.series(three_patches)
    culprit = name_of(three_patches, "scheduler")

    build = project.run("build")
    assert build.returncode == 1
    error = only_error(build)
    assert culprit in error and f"{rel} hunk #1" in error and "does not apply" in error
    assert not project.dist.exists() or not list(project.dist.iterdir())

    check = project.run("check")
    assert check.returncode == 1
    error = only_error(check)
    assert error.startswith(f"error: {culprit}: ") and "conflict" in error and rel in error
    assert f"FAIL {culprit}" in check.stdout.splitlines()


def test_patch_needing_an_offset_fails_check_and_build_reports_the_offset(project, three_patches):
    rel = EDITS["server"][0]
    repin(project, {**UPSTREAM, rel: moved_down(UPSTREAM[rel])})
    project.series(three_patches)
    culprit = name_of(three_patches, "server")

    build = project.ok("build")
    (line,) = [line for line in build.stdout.splitlines() if culprit in line]
    assert "offset" in line and "(offset 4)" in line
    assert len(list(project.dist.glob("*.whl"))) == 1

    check = project.run("check")
    assert check.returncode == 1
    # Its hunk line numbers also differ from what the tree exports, so it is stale too.
    errors = [line for line in check.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith(f"error: {culprit}: {TAG}: offset hunk #1"), check.stderr
    assert all(e.startswith(f"error: {culprit}: ") for e in errors), check.stderr
    assert f"FAIL {culprit}" in check.stdout.splitlines()


def edit_date(patches: dict[str, bytes], name: str) -> dict[str, bytes]:
    fixed = b"Date: Sat, 1 Jan 2000 00:00:00 +0000"
    assert fixed in patches[name]
    return {**patches, name: patches[name].replace(fixed, b"Date: Mon, 3 Jan 2000 10:00:00 +0100")}


def edit_whitespace(patches: dict[str, bytes], name: str) -> dict[str, bytes]:
    # git am drops trailing whitespace and collapses blank lines in the message.
    text = patches[name].replace(b"\n\nWhy-Patch:", b"\n\n\nWhy-Patch:", 1)
    return {**patches, name: text.replace(b"Tests: ", b"Tests:  ", 1)}


def swap_series(patches: dict[str, bytes], name: str) -> dict[str, bytes]:
    # Listing a patch out of its numbered place exports it under another number.
    names = list(patches)
    names.remove(name)
    return {n: patches[n] for n in [name, *names]}


@pytest.mark.parametrize("edit", [edit_date, edit_whitespace, swap_series])
def test_hand_edited_patch_makes_check_report_the_series_stale(project, three_patches, edit):
    culprit = name_of(three_patches, "server")
    project.series(edit(three_patches, culprit))
    check = project.run("check")
    assert check.returncode == 1
    errors = [line for line in check.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all("stale" in e or "lacks" in e for e in errors), check.stderr
    assert any(e.startswith(f"error: {culprit}: stale") for e in errors), check.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (message("environ: x").replace("Why-Patch: the change", "Why: the change"), "Why-Patch"),
        (message("environ: x").replace("Tests: tests/fake/test_hook.py\n", ""), "Tests"),
        (message("environ: x", status="maybe later"), "Upstream-Status 'maybe'"),
        (message("environ: x", tests="tests/fake/test_gone.py"), "tests/fake/test_gone.py"),
    ],
)
def test_patch_without_a_valid_header_field_fails_check_naming_patch_and_field(
    tmp_path, text, expected
):
    patches = series_from_commits(tmp_path, [("environ", text)])
    project = new_project(tmp_path)
    project.series(patches)
    check = project.run("check")
    assert check.returncode == 1
    (culprit,) = patches
    error = only_error(check)
    assert error.startswith(f"error: {culprit}: ") and expected in error, error
    assert f"FAIL {culprit}" in check.stdout.splitlines()


def test_wrong_upstream_sha256_fails_build_naming_the_wheel_and_builds_nothing(project):
    pin = project.patches / "upstream.toml"
    wheel = project.cache / f"{NAME}-{VERSION}-{TAG}.whl"
    pin.write_text(pin.read_text().replace(sha256(wheel), "0" * 64))
    build = project.run("build")
    assert build.returncode == 1
    error = only_error(build)
    assert "sha256 mismatch" in error and wheel.name in error
    assert not project.dist.exists() or not list(project.dist.iterdir())
    assert not (project.root / "build" / "src").exists()


def test_overlay_file_colliding_with_an_upstream_file_is_refused(project):
    project.overlay(EDITS["server"][0], "SERVER_1 = 'ours'\n")
    for command in ("build", "check"):
        result = project.run(command)
        assert result.returncode == 1, command
        error = only_error(result)
        assert f"overlay/{EDITS['server'][0]} collides with an upstream file" in error
    assert not project.dist.exists() or not list(project.dist.iterdir())
