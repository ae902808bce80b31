#!/usr/bin/env bash
# Prefill engine: sglang.launch_server in PD prefill mode, configured by the env files.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

main() {
  parse_args prefill "$@"
  load_env prefill
  require MODEL_PATH SERVED_MODEL_NAME TP_SIZE PREFILL_HOST PREFILL_PORT PREFILL_BOOTSTRAP_PORT \
    TRANSFER_BACKEND
  local -a extra=()
  read -r -a extra <<<"${PREFILL_ARGS:-}"
  engine_command
  CMD+=(--host "$PREFILL_HOST" --port "$PREFILL_PORT" --disaggregation-mode prefill
    --disaggregation-bootstrap-port "$PREFILL_BOOTSTRAP_PORT"
    --disaggregation-transfer-backend "$TRANSFER_BACKEND" "${extra[@]}")
  run_or_print prefill "${CMD[@]}"
}

main "$@"
