#!/usr/bin/env bash
# Decode engine: sglang.launch_server in PD decode mode, configured by the env files.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

main() {
  parse_args decode "$@"
  load_env decode
  require MODEL_PATH SERVED_MODEL_NAME TP_SIZE DECODE_HOST DECODE_PORT TRANSFER_BACKEND
  local -a extra=()
  read -r -a extra <<<"${DECODE_ARGS:-}"
  engine_command
  CMD+=(--host "$DECODE_HOST" --port "$DECODE_PORT" --disaggregation-mode decode
    --disaggregation-transfer-backend "$TRANSFER_BACKEND" "${extra[@]}")
  run_or_print decode "${CMD[@]}"
}

main "$@"
