#!/usr/bin/env bash
# Router: the smg gateway in PD mode in front of the prefill and decode engines.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# The Python interpreter of an smg console script (its #! line): smg_keyfile.py runs under it.
smg_python() {
  local line=""
  [[ -f "$1" ]] && IFS= read -r line <"$1"
  if [[ "$line" =~ ^\#!(/[^[:space:]]*python[^[:space:]]*)$ ]]; then
    printf '%s\n' "${BASH_REMATCH[1]}"
  else
    echo "launch/router.sh: API_KEY is set, and SMG_BIN=$1 is not a Python console script;" \
      "the key can only be kept off smg's command line through smg's Python entry point" >&2
    exit 2
  fi
}

main() {
  parse_args router "$@"
  load_env router
  require ROUTER_HOST ROUTER_PORT ROUTER_PROMETHEUS_PORT
  local -a extra=()
  read -r -a extra <<<"${ROUTER_ARGS:-}"
  CMD=("$(from_root "${SMG_BIN:-smg}")" launch --pd-disaggregation)
  if has_instance_files; then
    # Several engines: smg reads its worker list from a file that launch/pd writes and
    # rewrites (rolling-restart takes an instance out and puts it back). smg rereads the file
    # as soon as it changes; the periodic reread is only a backstop.
    CMD+=(--discovery-provider file --discovery-check-interval-secs 5
      --discovery-file "$(root_path "${PD_RUN_DIR:-run}")/router-workers.json")
  else
    require PREFILL_HOST PREFILL_PORT PREFILL_BOOTSTRAP_PORT DECODE_HOST DECODE_PORT
    CMD+=(--prefill "http://$PREFILL_HOST:$PREFILL_PORT" "$PREFILL_BOOTSTRAP_PORT"
      --decode "http://$DECODE_HOST:$DECODE_PORT")
  fi
  # smg's own default puts its Prometheus endpoint on every interface (0.0.0.0, or :: for an
  # IPv6 --host); here it listens on the router's host unless ROUTER_PROMETHEUS_HOST says where.
  CMD+=(--host "$ROUTER_HOST" --port "$ROUTER_PORT" --prometheus-port "$ROUTER_PROMETHEUS_PORT"
    --prometheus-host "${ROUTER_PROMETHEUS_HOST:-$ROUTER_HOST}")
  if [[ -n "${API_KEY:-}" ]]; then
    # Not --api-key on smg's command line (any local user reads it): the key goes to a 0600 file
    # and launch/smg_keyfile.py hands it to smg inside the process.
    local keyfile python
    python="$(smg_python "${CMD[0]}")"
    keyfile="$(secret_file router.key)"
    write_secret "$keyfile" "$API_KEY"
    CMD=("$python" "$PD_ROOT/launch/smg_keyfile.py" --api-key-file "$keyfile" "${CMD[@]:1}")
  fi
  # Empty or unset: smg's own default applies. ROUTER_ARGS comes last, so a flag there wins.
  if [[ -n "${ROUTER_SHUTDOWN_GRACE_S:-}" ]]; then
    [[ "$ROUTER_SHUTDOWN_GRACE_S" =~ ^[0-9]+$ ]] || {
      echo "launch/router.sh: ROUTER_SHUTDOWN_GRACE_S=$ROUTER_SHUTDOWN_GRACE_S:" \
        "must be a whole number of seconds" >&2
      exit 2
    }
    CMD+=(--shutdown-grace-period-secs "$ROUTER_SHUTDOWN_GRACE_S")
  fi
  CMD+=("${extra[@]}")
  run_or_print router "${CMD[@]}"
}

main "$@"
