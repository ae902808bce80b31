#!/usr/bin/env bash
# Build patched sglang wheels from the pinned upstream release, our overlay/ and patches/.
# The logic lives in tools/series.py; this script prepares the Python it runs with and runs
# the project's test command.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOOLS_VENV="$ROOT/build/tools-venv"
TEST_VENV="$ROOT/.venv"
# Debian's prometheus and prometheus-node-exporter packages, for the monitoring tests.
PROMETHEUS_DIR="${SM120PD_PROMETHEUS_DIR:-$ROOT/build/prometheus}"

usage() {
  cat <<'USAGE'
usage: ./build.sh [COMMAND] [OPTIONS]

Commands:
  (none) | build   build the patched wheel for this Python and platform into dist/
                   --python 3.11|3.12|3.13  --platform x86_64|aarch64  --all (every pinned tag)
  check            apply the series on a fresh tree for every pinned tag; fail on a patch that
                   needs an offset or does not apply, a stale export, or a missing header field
  refresh          export the commits after "overlay" in build/src into patches/ and the
                   overlay files into overlay/
  rebase VERSION   try the series on another upstream release and print a table (changes nothing)
  label            print the local version label of the current series
  test [ARGS]      create .venv, install the pinned test dependencies, unpack Debian's
                   prometheus packages into build/prometheus, build and install the patched
                   wheel, run ruff check, ruff format --check, shellcheck and pytest on
                   PYTEST_WORKERS parallel workers (default 2; 0: one process) (ARGS go to
                   pytest)
  prometheus       only the step of "test" that unpacks Debian's prometheus and
                   prometheus-node-exporter packages into build/prometheus (skipped when
                   their binaries are there); each .deb's SHA256 is checked against apt's lists
  clean            remove build/ and dist/ (the upstream wheel cache is kept)

Environment: SM120PD_CACHE  upstream wheel cache (default ~/.cache/sm120pd/upstream)
             SM120PD_PROMETHEUS_DIR  where the prometheus step unpacks (default build/prometheus)
             PYTHON         interpreter for the tools and .venv (default python3)
Run "./build.sh COMMAND --help" for a command's options.
USAGE
}

tools_python() {
  local py="$TOOLS_VENV/bin/python"
  if [[ ! -x "$py" ]] || ! "$py" -c 'import wheel' 2>/dev/null; then
    echo "setting up build tools in build/tools-venv" >&2
    "${PYTHON:-python3}" -m venv --clear "$TOOLS_VENV"
    local -a requirements
    read -r -a requirements <<<"$(build_requirements)"
    "$py" -m pip install --quiet "${requirements[@]}"
  fi
  printf '%s\n' "$py"
}

build_requirements() {
  "${PYTHON:-python3}" -c '
import tomllib
with open("'"$ROOT"'/pyproject.toml", "rb") as f:
    print(" ".join(tomllib.load(f)["dependency-groups"]["build"]))'
}

series() {
  local py
  py="$(tools_python)"
  (cd "$ROOT" && "$py" tools/series.py "$@")
}

# Debian packages unpacked into build/prometheus for the monitoring tests, and the files under
# usr/bin that say each is there.
PROMETHEUS_PACKAGES=(prometheus prometheus-node-exporter)
package_binaries() {
  case "$1" in
    prometheus) echo "prometheus promtool" ;;
    prometheus-node-exporter) echo "prometheus-node-exporter" ;;
  esac
}

prometheus_tools() (
  # Unpacked into build/prometheus, not installed: installing the packages would also enable and
  # start Prometheus and node_exporter services on the machine. The binaries need only libc.
  # A subshell: the trap below removes the download directories however the step ends.
  local -a missing=()
  local pkg bin tool
  for pkg in "${PROMETHEUS_PACKAGES[@]}"; do
    for bin in $(package_binaries "$pkg"); do
      if [[ ! -x "$PROMETHEUS_DIR/usr/bin/$bin" ]]; then
        missing+=("$pkg")
        break
      fi
    done
  done
  if ((${#missing[@]} == 0)); then
    return 0
  fi
  for tool in apt-get apt-cache dpkg-deb sha256sum; do
    if ! command -v "$tool" >/dev/null; then
      echo "error: the monitoring tests need Debian's ${PROMETHEUS_PACKAGES[*]} packages;" \
        "this machine has no $tool to fetch them into $PROMETHEUS_DIR" >&2
      exit 1
    fi
  done
  echo "== unpacking Debian's ${missing[*]} into $PROMETHEUS_DIR"
  local download verified
  download="$(apt_download_dir)"
  verified="$(mktemp -d)" # ours alone (0700): the copies that are checked and unpacked
  trap 'rm -rf "$download" "$verified"' EXIT
  local downloaded
  if ! downloaded="$(download_packages "$download" "${missing[@]}")"; then
    if [[ "$(id -u)" != 0 ]]; then
      echo "error: apt-get download ${missing[*]} failed; as root, run apt-get update and retry" >&2
      exit 1
    fi
    apt-get update -qq
    downloaded="$(download_packages "$download" "${missing[@]}")"
  fi
  local -a specs
  mapfile -t specs <<<"$downloaded"
  if [[ "$(id -u)" == 0 ]]; then
    # apt is done: nobody but root may add, swap or change anything in there from now on.
    chown root: "$download"
    chmod 0700 "$download"
  fi
  # Every file is copied and checked before anything is unpacked: one bad file, nothing unpacked.
  local -a debs=()
  local spec
  for spec in "${specs[@]}"; do
    debs+=("$(verified_copy "$spec" "$download" "$verified")")
  done
  mkdir -p "$PROMETHEUS_DIR"
  local deb
  for deb in "${debs[@]}"; do
    dpkg-deb -x "$deb" "$PROMETHEUS_DIR"
  done
  if [[ " ${missing[*]} " == *" prometheus "* ]]; then
    "$PROMETHEUS_DIR/usr/bin/promtool" --version | head -n 1
  fi
)

apt_download_dir() {
  # The directory apt-get download writes into. As root, apt downloads as its unprivileged user
  # _apt, so the directory is _apt's alone (0700), not world-writable; elsewhere it is the
  # caller's own (mktemp's 0700). Nothing in it is trusted: verified_copy takes only the exact
  # file apt names and checks its SHA256.
  local dir
  dir="$(mktemp -d)"
  if [[ "$(id -u)" == 0 ]] && id _apt >/dev/null 2>&1; then
    if ! chown _apt: "$dir"; then
      chmod 1733 "$dir" # at least nobody can remove or rename what another user wrote
    fi
  fi
  printf '%s\n' "$dir"
}

download_packages() {
  # DIR PACKAGE...: download each package's candidate version into DIR; print PACKAGE=VERSION
  # for each (the exact versions whose SHA256 verified_copy checks).
  local dir="$1" pkg version
  shift
  local -a specs=()
  for pkg in "$@"; do
    version="$(apt-cache show --no-all-versions "$pkg" | sed -n 's/^Version: //p' | head -n 1)"
    if [[ -z "$version" ]]; then
      echo "error: apt-cache show $pkg: no candidate version" >&2
      return 1
    fi
    specs+=("$pkg=$version")
  done
  (cd "$dir" && apt-get download -q "${specs[@]}") >&2 || return 1
  printf '%s\n' "${specs[@]}"
}

verified_copy() {
  # PACKAGE=VERSION DIR DEST: copy the .deb apt-get download wrote into DIR for that version
  # into DEST (a directory only we can write) and print the copy's path, if its SHA256 is the
  # one apt's lists give for exactly that version. Anything else in DIR is never looked at.
  local spec="$1" dir="$2" dest="$3" record name want got
  record="$(apt-cache show --no-all-versions "$spec")"
  name="$(sed -n 's/^Filename: //p' <<<"$record" | head -n 1)"
  name="${name##*/}"
  want="$(sed -n 's/^SHA256: //p' <<<"$record")"
  if [[ -z "$name" || -z "$want" || "$name" != *.deb || "$name" == .* ]]; then
    echo "error: apt-cache show $spec gives no Filename or SHA256 to check the download against" >&2
    exit 1
  fi
  if [[ -L "$dir/$name" || ! -f "$dir/$name" ]]; then
    echo "error: apt-get download $spec left no regular file $name" >&2
    exit 1
  fi
  cp -- "$dir/$name" "$dest/$name"
  got="$(sha256sum <"$dest/$name" | cut -d ' ' -f 1)"
  if ! grep -qxF -- "$got" <<<"$want"; then
    echo "error: refusing to unpack $name: its SHA256 is $got, but apt's lists give" \
      "$(tr '\n' ' ' <<<"$want")for $spec; nothing was unpacked" >&2
    exit 1
  fi
  printf '%s\n' "$dest/$name"
}

run_tests() {
  if [[ ! -x "$TEST_VENV/bin/python" ]]; then
    echo "== creating .venv"
    "${PYTHON:-python3}" -m venv "$TEST_VENV"
  fi
  echo "== installing test dependencies (tests/requirements.txt)"
  "$TEST_VENV/bin/python" -m pip install --quiet --requirement "$ROOT/tests/requirements.txt"
  prometheus_tools
  echo "== building the patched wheel"
  series build
  local wheel
  wheel="$(host_wheel)"
  echo "== installing $(basename "$wheel")"
  "$TEST_VENV/bin/python" -m pip install --quiet --no-deps --force-reinstall "$wheel"
  cd "$ROOT"
  echo "== ruff check"
  "$TEST_VENV/bin/ruff" check .
  echo "== ruff format --check"
  "$TEST_VENV/bin/ruff" format --check .
  echo "== shellcheck"
  "$TEST_VENV/bin/shellcheck" --external-sources build.sh .ci/run launch/pd launch/*.sh bench/kernel/microbench bench/kernel/audit bench/kernel/gpu_session
  echo "== pytest (${PYTEST_WORKERS:-2} workers)"
  # Two workers by default: tests/conftest.py keeps the real-engine tests on one and the rest,
  # mostly waiting on subprocesses, on the other. PYTEST_WORKERS=0 runs them all in this process.
  "$TEST_VENV/bin/python" -m pytest -n "${PYTEST_WORKERS:-2}" "$@"
}

host_wheel() {
  local label tag
  label="$(series label)"
  tag="$("$TEST_VENV/bin/python" -c '
import sys, os
print(f"cp{sys.version_info[0]}{sys.version_info[1]}-cp{sys.version_info[0]}{sys.version_info[1]}-manylinux_2_34_{os.uname().machine}")')"
  local wheels=("$ROOT"/dist/*+"$label"-"$tag".whl)
  if [[ ! -f "${wheels[0]}" ]]; then
    echo "error: no wheel for label $label and tag $tag in dist/" >&2
    exit 1
  fi
  printf '%s\n' "${wheels[0]}"
}

main() {
  local command="${1:-build}"
  case "$command" in
    -h | --help | help) usage ;;
    test)
      shift
      if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
        usage
        return 0
      fi
      run_tests "$@"
      ;;
    prometheus) prometheus_tools ;;
    clean)
      rm -rf "$ROOT/build" "$ROOT/dist"
      echo "removed build/ and dist/"
      ;;
    *) series "$@" ;;
  esac
}

main "$@"
