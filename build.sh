#!/usr/bin/env bash
# Build patched sglang wheels from the pinned upstream release, our overlay/ and patches/.
# The logic lives in tools/series.py; this script prepares the Python it runs with and runs
# the project's test command.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOOLS_VENV="$ROOT/build/tools-venv"
TEST_VENV="$ROOT/.venv"
# Debian's prometheus package (the server and promtool), for the monitoring tests.
PROMETHEUS_DIR="$ROOT/build/prometheus"

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
                   prometheus package into build/prometheus, build and install the patched
                   wheel, run ruff check, ruff format --check, shellcheck and pytest
                   (ARGS go to pytest)
  clean            remove build/ and dist/ (the upstream wheel cache is kept)

Environment: SM120PD_CACHE  upstream wheel cache (default ~/.cache/sm120pd/upstream)
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

prometheus_tools() {
  # Unpacked into build/prometheus, not installed: installing the package would also enable and
  # start a Prometheus service on the machine. The binaries need only libc.
  if [[ -x "$PROMETHEUS_DIR/usr/bin/prometheus" && -x "$PROMETHEUS_DIR/usr/bin/promtool" ]]; then
    return 0
  fi
  if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "error: the monitoring tests need Debian's prometheus package (prometheus, promtool);" \
      "this machine has no apt-get/dpkg-deb to fetch it into build/prometheus" >&2
    exit 1
  fi
  echo "== unpacking Debian's prometheus package into build/prometheus"
  local tmp
  tmp="$(mktemp -d)"
  chmod 0777 "$tmp" # apt's download user writes there
  if ! (cd "$tmp" && apt-get download -qq prometheus 2>/dev/null); then
    if [[ "$(id -u)" != 0 ]]; then
      rm -rf "$tmp"
      echo "error: apt-get download prometheus failed; as root, run apt-get update and retry" >&2
      exit 1
    fi
    apt-get update -qq
    (cd "$tmp" && apt-get download -qq prometheus)
  fi
  rm -rf "$PROMETHEUS_DIR"
  mkdir -p "$PROMETHEUS_DIR"
  dpkg-deb -x "$tmp"/prometheus_*.deb "$PROMETHEUS_DIR"
  rm -rf "$tmp"
  "$PROMETHEUS_DIR/usr/bin/promtool" --version | head -n 1
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
  echo "== pytest"
  "$TEST_VENV/bin/python" -m pytest "$@"
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
    clean)
      rm -rf "$ROOT/build" "$ROOT/dist"
      echo "removed build/ and dist/"
      ;;
    *) series "$@" ;;
  esac
}

main "$@"
