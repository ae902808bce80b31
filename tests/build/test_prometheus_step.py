"""build.sh's prometheus step (`./build.sh prometheus`, run by `./build.sh test`): what apt-get
download wrote is unpacked only when it is the exact file apt names for the version it was asked
for, and its SHA256 is the one apt's lists give; the download directory is nobody else's.

apt-get and apt-cache are fakes on PATH (offline, fast); the .deb files are real, built here with
dpkg-deb, and their SHA256s are computed here, not by the step.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")

VERSIONS = {"prometheus": "2.0.0+ds-1", "prometheus-node-exporter": "1.5.0-1"}

FAKE_APT_CACHE = r"""#!/usr/bin/env bash
# apt-cache show --no-all-versions PACKAGE[=VERSION]: the record in $FAKE_APT/PACKAGE.record
spec="${!#}"
pkg="${spec%%=*}"
[[ -f "$FAKE_APT/$pkg.record" ]] || exit 100
if [[ "$spec" == *=* ]] && ! grep -qxF "Version: ${spec#*=}" "$FAKE_APT/$pkg.record"; then
  exit 100
fi
cat "$FAKE_APT/$pkg.record"
"""

FAKE_APT_GET = r"""#!/usr/bin/env bash
# apt-get download PACKAGE=VERSION...: writes $FAKE_APT/PACKAGE.served under the record's
# Filename, then whatever is in $FAKE_APT/plant (another user writing into the directory).
echo "$*" >>"$FAKE_APT/apt-get.log"
[[ "$1" == download ]] || exit 0
stat -c '%a %U' . >"$FAKE_APT/download-dir"
if [[ -f "$FAKE_APT/fail" ]]; then
  cat "$FAKE_APT/fail" >&2
  exit 100
fi
for arg in "${@:2}"; do
  [[ "$arg" == -* ]] && continue
  pkg="${arg%%=*}"
  name="$(sed -n 's/^Filename: //p' "$FAKE_APT/$pkg.record")"
  cp "$FAKE_APT/$pkg.served" "./${name##*/}"
done
if [[ -d "$FAKE_APT/plant" ]]; then
  cp -a "$FAKE_APT/plant/." .
fi
"""


def build_deb(work: Path, package: str, version: str, files: dict[str, str]) -> Path:
    tree = work / f"{package}-{version}-tree"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {package}\nVersion: {version}\nArchitecture: all\n"
        "Maintainer: tests <tests@example.invalid>\nDescription: a test package\n"
    )
    for rel, text in files.items():
        path = tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    deb = work / f"{package}-{version}.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "--build", str(tree), str(deb)],
        check=True,
        capture_output=True,
    )
    return deb


def script(says: str) -> str:
    return f"#!/bin/sh\necho '{says}'\n"


class Step:
    """A fake apt serving genuine packages, and build.sh's step run against it."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.apt = tmp / "apt"
        self.bin = tmp / "bin"
        self.out = tmp / "out"
        self.tmpdir = tmp / "tmpdir"
        for d in (self.apt, self.bin, self.tmpdir):
            d.mkdir()
        for name, text in (("apt-cache", FAKE_APT_CACHE), ("apt-get", FAKE_APT_GET)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        debs = tmp / "debs"
        debs.mkdir()
        self.genuine = {
            "prometheus": build_deb(
                debs,
                "prometheus",
                VERSIONS["prometheus"],
                {
                    "usr/bin/prometheus": script("genuine prometheus"),
                    "usr/bin/promtool": script("promtool, version 2.0.0 genuine"),
                },
            ),
            "prometheus-node-exporter": build_deb(
                debs,
                "prometheus-node-exporter",
                VERSIONS["prometheus-node-exporter"],
                {"usr/bin/prometheus-node-exporter": script("genuine node_exporter")},
            ),
        }
        self.evil = build_deb(
            debs,
            "prometheus",
            "0.0.1",
            {"usr/bin/promtool": script("evil promtool"), "usr/bin/evil": script("evil")},
        )
        for package, deb in self.genuine.items():
            version = VERSIONS[package]
            filename = f"pool/main/p/{package}/{package}_{version}_amd64.deb"
            digest = hashlib.sha256(deb.read_bytes()).hexdigest()
            (self.apt / f"{package}.record").write_text(
                f"Package: {package}\nVersion: {version}\nArchitecture: amd64\n"
                f"Filename: {filename}\nSize: {deb.stat().st_size}\nSHA256: {digest}\n"
                "Description: a test package\n SHA256: 0000 (a description line)\n"
            )
            shutil.copy(deb, self.apt / f"{package}.served")

    def run(self) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "PATH": f"{self.bin}:{os.environ['PATH']}",
            "FAKE_APT": str(self.apt),
            "TMPDIR": str(self.tmpdir),
            "SM120PD_PROMETHEUS_DIR": str(self.out),
        }
        return subprocess.run(
            ["bash", str(ROOT / "build.sh"), "prometheus"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def apt_get_calls(self) -> list[str]:
        log = self.apt / "apt-get.log"
        return log.read_text().splitlines() if log.exists() else []

    def unpacked(self) -> dict[str, str]:
        if not self.out.exists():
            return {}
        return {
            str(p.relative_to(self.out)): p.read_text() for p in self.out.rglob("*") if p.is_file()
        }


@pytest.fixture
def step(tmp_path: Path) -> Step:
    return Step(tmp_path)


def expected_download_dir_owner() -> str:
    if os.geteuid() == 0:
        try:
            return pwd.getpwnam("_apt").pw_name
        except KeyError:
            return "root"
    return pwd.getpwuid(os.geteuid()).pw_name


def test_the_genuine_packages_are_unpacked_from_a_private_download_dir(step):
    done = step.run()
    assert done.returncode == 0, done.stderr
    # apt was asked for exact versions, and downloaded into a directory only its download user
    # (or, not as root, the caller) can enter: 0700, no other user can plant anything in it.
    assert step.apt_get_calls() == [
        "download -q prometheus=2.0.0+ds-1 prometheus-node-exporter=1.5.0-1"
    ]
    mode, owner = (step.apt / "download-dir").read_text().split()
    assert (mode, owner) == ("700", expected_download_dir_owner())
    assert step.unpacked() == {
        "usr/bin/prometheus": script("genuine prometheus"),
        "usr/bin/promtool": script("promtool, version 2.0.0 genuine"),
        "usr/bin/prometheus-node-exporter": script("genuine node_exporter"),
    }
    assert stat.S_IMODE((step.out / "usr/bin/prometheus-node-exporter").stat().st_mode) & 0o111
    assert "promtool, version 2.0.0 genuine" in done.stdout
    # The download directories are gone.
    assert list(step.tmpdir.iterdir()) == []


@pytest.mark.parametrize("swapped", ["prometheus", "prometheus-node-exporter"])
def test_a_deb_whose_sha256_is_not_apts_is_refused_and_nothing_is_unpacked(step, swapped):
    # The file under apt's name is another (valid) package: what a local user swapping it in
    # between the download and the unpack would leave.
    shutil.copy(step.evil, step.apt / f"{swapped}.served")
    done = step.run()
    assert done.returncode != 0
    version = VERSIONS[swapped]
    error = next(ln for ln in done.stderr.splitlines() if ln.startswith("error: "))
    assert f"refusing to unpack {swapped}_{version}_amd64.deb" in error
    assert hashlib.sha256(step.evil.read_bytes()).hexdigest() in error
    assert f"for {swapped}={version}" in error and "nothing was unpacked" in error
    # Not even the other, genuine package: every file is checked before any is unpacked.
    assert step.unpacked() == {}
    assert list(step.tmpdir.iterdir()) == []


def test_planted_files_in_the_download_dir_are_neither_unpacked_nor_run(step):
    plant = step.apt / "plant"
    plant.mkdir()
    marker = step.tmp / "planted-script-ran"
    # A .deb the old `prometheus_*.deb` glob would have unpacked, and scripts named like the tools.
    shutil.copy(step.evil, plant / "prometheus_0.0.1_amd64.deb")
    shutil.copy(step.evil, plant / "aaa_prometheus.deb")
    for name in ("promtool", "prometheus", "dpkg-deb", "sha256sum"):
        (plant / name).write_text(f"#!/bin/sh\ntouch {marker}\n")
        (plant / name).chmod(0o755)
    done = step.run()
    assert done.returncode == 0, done.stderr
    unpacked = step.unpacked()
    assert "usr/bin/evil" not in unpacked
    assert unpacked["usr/bin/promtool"] == script("promtool, version 2.0.0 genuine")
    assert not marker.exists()


def test_nothing_is_downloaded_when_the_binaries_are_there(step):
    for name in ("prometheus", "promtool", "prometheus-node-exporter"):
        path = step.out / "usr/bin" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(script(f"already {name}"))
        path.chmod(0o755)
    done = step.run()
    assert done.returncode == 0, done.stderr
    assert step.apt_get_calls() == []


def test_only_the_missing_package_is_fetched_and_the_others_binaries_stay(step):
    for name in ("prometheus", "promtool"):
        path = step.out / "usr/bin" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(script(f"already {name}"))
        path.chmod(0o755)
    done = step.run()
    assert done.returncode == 0, done.stderr
    assert step.apt_get_calls() == ["download -q prometheus-node-exporter=1.5.0-1"]
    assert step.unpacked() == {
        "usr/bin/prometheus": script("already prometheus"),
        "usr/bin/promtool": script("already promtool"),
        "usr/bin/prometheus-node-exporter": script("genuine node_exporter"),
    }


def test_download_errors_are_shown(step):
    (step.apt / "fail").write_text("E: Failed to fetch http://deb.example/pool/x.deb  404\n")
    done = step.run()
    assert done.returncode != 0
    assert "E: Failed to fetch http://deb.example/pool/x.deb  404" in done.stderr
    assert step.unpacked() == {}
    if os.geteuid() == 0:  # as root the step refreshes apt's lists and tries once more
        assert step.apt_get_calls()[1] == "update -qq"
        assert len(step.apt_get_calls()) == 3
    else:
        assert "as root, run apt-get update and retry" in done.stderr
