"""Patch 0009: the server_args line an engine logs at start-up names no API key.

`launch/pd` gives the engines their key in a mode-0600 `--config` file; upstream's start-up log
line then printed it in clear (watermark secrets were already redacted there). These tests read
the dict that line is made of, for a server started with and without keys.
"""

from __future__ import annotations

import logging

import pytest
from sglang.srt.entrypoints import engine
from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils.api_key_redaction import REDACTED, redact_api_keys

KEY, ADMIN_KEY = "k-3f9c1e0d2b", "adm-77a4e5c6"
BASE = ["--model-path", "/models/not-read-here", "--device", "cpu"]


def test_the_logged_server_args_name_neither_key():
    args = prepare_server_args([*BASE, "--api-key", KEY, "--admin-api-key", ADMIN_KEY])
    logged = engine._server_args_for_logging(args)
    line = f"server_args={logged}"
    assert KEY not in line and ADMIN_KEY not in line, line
    assert logged["api_key"] == REDACTED and logged["admin_api_key"] == REDACTED
    # Only the log copy is redacted: the server still checks requests against the real keys.
    assert args.api_key == KEY and args.admin_api_key == ADMIN_KEY
    # Everything else is logged as before.
    assert logged["device"] == "cpu" and logged["model_path"] == "/models/not-read-here"


def test_an_unset_key_is_logged_as_unset():
    logged = engine._server_args_for_logging(prepare_server_args(BASE))
    assert logged["api_key"] is None and logged["admin_api_key"] is None


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_start_up_log_record_carries_no_key():
    # The same call engine.py makes at start-up, through its own logger (sglang's loggers do
    # not always propagate to the root, so a handler is attached to it directly).
    args = prepare_server_args([*BASE, "--api-key", KEY])
    records, level = _Records(), engine.logger.level
    engine.logger.addHandler(records)
    engine.logger.setLevel(logging.INFO)
    try:
        engine.logger.info(f"server_args={engine._server_args_for_logging(args)}")
    finally:
        engine.logger.removeHandler(records)
        engine.logger.setLevel(level)
    assert len(records.lines) == 1 and KEY not in records.lines[0]
    assert f"'api_key': '{REDACTED}'" in records.lines[0]


@pytest.mark.parametrize("value", [None, ""])
def test_redact_api_keys_keeps_unset_values(value):
    assert redact_api_keys({"api_key": value, "port": 30000}) == {"api_key": value, "port": 30000}
