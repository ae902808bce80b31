# shellcheck shell=bash
# Shared glue for prefill.sh, decode.sh and router.sh (sourced, not run).
# Reads common.env and the role's env file the way systemd's EnvironmentFile= does, builds the
# role's command line, and either prints it (--dry-run, secrets redacted) or execs it.

PD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_DIR="$PD_ROOT/env"
SIM=0
DRY_RUN=0
INSTANCE=""

usage() {
  cat <<USAGE
usage: launch/$1.sh [--env-dir DIR] [--instance N] [--sim] [--dry-run]

Start the $1 role from DIR/common.env and DIR/$1.env (default DIR: env/), replacing this shell
with the server process.
  --env-dir DIR  directory holding common.env, prefill.env, decode.env, router.env
  --instance N   engines only: read DIR/$1.N.env last (instance N of several; default: none)
  --sim          start the simulated engine (launch/sim_engine.py) instead of sglang;
                 the router is the real smg either way
  --dry-run      print the command and the environment taken from the env files, start nothing
USAGE
}

parse_args() {
  local role="$1"
  ROLE="$role"
  shift
  while (($#)); do
    case "$1" in
      --env-dir)
        [[ $# -ge 2 ]] || { echo "launch/$role.sh: --env-dir needs a directory" >&2; exit 2; }
        ENV_DIR="$2"
        shift 2
        ;;
      --instance)
        [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ && "$role" != router ]] || {
          echo "launch/$role.sh: --instance needs a number N (DIR/$role.N.env), engines only" >&2
          exit 2
        }
        INSTANCE="$2"
        shift 2
        ;;
      --sim) SIM=1; shift ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h | --help) usage "$role"; exit 0 ;;
      *) echo "launch/$role.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
  done
}

# The files a role reads, in order: common, the role's, and the instance's when --instance N.
env_files() {
  local role="$1"
  ENV_FILES=("$ENV_DIR/common.env" "$ENV_DIR/$role.env")
  if [[ -n "$INSTANCE" ]]; then
    ENV_FILES+=("$ENV_DIR/$role.$INSTANCE.env")
  fi
}

load_env() {
  local role="$1" file
  env_files "$role"
  for file in "${ENV_FILES[@]}"; do
    [[ -f "$file" ]] || { echo "launch/$role.sh: missing env file $file" >&2; exit 2; }
  done
  set -a
  for file in "${ENV_FILES[@]}"; do
    # shellcheck disable=SC1090,SC1091
    . "$file"
  done
  set +a
}

# True when DIR holds instance files (prefill.N.env, decode.N.env): several engines.
has_instance_files() {
  local file
  for file in "$ENV_DIR"/prefill.*.env "$ENV_DIR"/decode.*.env; do
    [[ "${file##*/}" =~ ^(prefill|decode)\.[1-9][0-9]*\.env$ ]] && return 0
  done
  return 1
}

require() {
  local name
  for name in "$@"; do
    [[ -n "${!name:-}" ]] || { echo "launch: $name is not set in $ENV_DIR" >&2; exit 2; }
  done
}

# A path from the env files: absolute as given, else under the repository root.
root_path() {
  case "$1" in
    /*) printf '%s\n' "$1" ;;
    *) printf '%s\n' "$PD_ROOT/$1" ;;
  esac
}

from_root() {
  case "$1" in
    /*) printf '%s\n' "$1" ;;
    */*) printf '%s\n' "$PD_ROOT/$1" ;;
    *) command -v "$1" || printf '%s\n' "$1" ;;
  esac
}

engine_command() {
  local python
  python="$(from_root "${PD_PYTHON:-python3}")"
  if ((SIM)); then
    CMD=("$python" "$PD_ROOT/launch/sim_engine.py")
  else
    CMD=("$python" -m sglang.launch_server)
  fi
  CMD+=(--model-path "$MODEL_PATH" --served-model-name "$SERVED_MODEL_NAME" --tp-size "$TP_SIZE")
  if [[ -n "${API_KEY:-}" ]]; then
    # Not --api-key: any local user reads a command line. sglang reads the key from a YAML
    # --config file that only this user can read (YAML single quotes: ' doubles).
    local config
    config="$(secret_file "$ROLE${INSTANCE:+-$INSTANCE}.yaml")"
    write_secret "$config" "api-key: '${API_KEY//\'/\'\'}'"
    CMD+=(--config "$config")
  fi
}

# Where a role's secret file goes: PD_RUN_DIR/secrets (mode 0700); `launch/pd down` removes it.
secret_file() {
  printf '%s/secrets/%s\n' "$(root_path "${PD_RUN_DIR:-run}")" "$1"
}

# write_secret FILE CONTENT: mode 0600, written whole (a new mktemp file, then renamed over FILE,
# never through a link); only into a directory of this user's (0700); not in --dry-run.
write_secret() {
  ((DRY_RUN)) && return 0
  local dir
  dir="$(dirname "$1")"
  (
    umask 077
    mkdir -p "$dir" || exit 1
    if [[ -L "$dir" || ! -O "$dir" ]]; then
      echo "launch: $dir is not a directory of this user's own; the secret is not written there" >&2
      exit 1
    fi
    chmod 700 "$dir" || exit 1
    tmp="$(mktemp "$dir/.${1##*/}.XXXXXX")" || exit 1
    if ! { printf '%s\n' "$2" >"$tmp" && mv -fT "$tmp" "$1"; }; then
      rm -f "$tmp"
      exit 1
    fi
  ) || { echo "launch: cannot write the secret file $1" >&2; exit 2; }
}

env_keys() {
  sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/\1/p' "$@" | awk '!seen[$0]++'
}

is_secret_name() {
  [[ "${1^^}" =~ (KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL) ]]
}

print_dry_run() {
  local key word previous=""
  shift
  echo "# environment from ${ENV_FILES[*]}"
  while read -r key; do
    if is_secret_name "$key" && [[ -n "${!key}" ]]; then
      printf '%s=<redacted>\n' "$key"
    else
      printf '%s=%s\n' "$key" "${!key}"
    fi
  done < <(env_keys "${ENV_FILES[@]}")
  echo "# command"
  for word in "$@"; do
    if [[ "$previous" == --api-key ]]; then
      printf '%s ' '<redacted>'
    else
      printf '%q ' "$word"
    fi
    previous="$word"
  done
  printf '\n'
}

run_or_print() {
  local role="$1"
  shift
  if ((DRY_RUN)); then
    print_dry_run "$role" "$@"
  else
    exec "$@"
  fi
}
