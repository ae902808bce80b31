"""Keep the server's API keys out of the server_args line it logs at start-up.

sglang logs its resolved server_args once at start-up (`entrypoints/engine.py`,
`_server_args_for_logging`). Upstream redacts the watermark secrets there but prints `api_key`
and `admin_api_key` in clear, so a key passed privately (a mode-0600 `--config` file, as
`launch/pd` does) still lands in the log file or, under systemd, in the journal that other users
may read. Patch 0009 passes that dict through `redact_api_keys` as well. Nothing else changes:
the server still checks requests against the real keys.
"""

from __future__ import annotations

from typing import Any

API_KEY_FIELDS = ("api_key", "admin_api_key")
REDACTED = "<redacted>"


def redact_api_keys(values: dict[str, Any]) -> dict[str, Any]:
    """A copy of `values` with every set API key replaced by "<redacted>"; an unset key (None
    or empty) is kept as it is, so the log still tells whether a key was configured."""
    out = dict(values)
    for name in API_KEY_FIELDS:
        if out.get(name):
            out[name] = REDACTED
    return out
