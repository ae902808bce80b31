"""What an engine holds, from its scheduler's load snapshot (GET /v1/loads)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from launch.pdlib import loads

# GET /v1/loads from a real env/cpu prefill while a room waited for decode to take its KV
# (trimmed of the memory and queues sections): running 0 and waiting 0, as the /metrics gauges
# also read, and the room only under "disaggregation".
PREFILL_ROOM_INFLIGHT = {
    "timestamp": 1796334513.34,
    "dp_rank": 0,
    "num_running_reqs": 0,
    "num_waiting_reqs": 0,
    "num_used_tokens": 6,
    "num_total_tokens": 6,
    "token_usage": 0.0004,
    "disaggregation": {
        "mode": "prefill",
        "prefill_bootstrap_queue_reqs": 0,
        "prefill_inflight_queue_reqs": 1,
        "decode_prealloc_queue_reqs": 0,
        "decode_transfer_queue_reqs": 0,
        "decode_retracted_queue_reqs": 0,
        "kv_transfer_speed_gb_s": 0.0,
        "kv_transfer_latency_ms": 0.0,
    },
}


def test_a_room_in_prefills_inflight_queue_is_held_though_nothing_runs_or_waits():
    assert loads.held([PREFILL_ROOM_INFLIGHT]) == {
        "num_used_tokens": 6,
        "prefill_inflight_queue_reqs": 1,
    }
    assert loads.held([PREFILL_ROOM_INFLIGHT], tokens=False) == {"prefill_inflight_queue_reqs": 1}


def test_ranks_are_summed_and_an_idle_engine_holds_nothing():
    idle = dict(PREFILL_ROOM_INFLIGHT, num_used_tokens=0)
    idle["disaggregation"] = dict(idle["disaggregation"], prefill_inflight_queue_reqs=0)
    assert loads.held([idle, idle]) == {}
    busy = dict(idle, num_running_reqs=2, num_waiting_reqs=1)
    assert loads.held([busy, busy]) == {"num_running_reqs": 4, "num_waiting_reqs": 2}
    assert loads.describe({}) == "nothing held"


class _Server:
    def __init__(self, status: int, body: bytes):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.auth = self.headers.get("Authorization")
                self.send_response(status)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args):
                pass

        self.auth = None
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, json.dumps({"loads": [PREFILL_ROOM_INFLIGHT]}).encode(), None),
        (401, b"Unauthorized", "GET /v1/loads: 401"),
        (200, b"<html>", "GET /v1/loads: not the JSON sglang answers"),
        (200, b'{"loads": 3}', "GET /v1/loads: not the JSON sglang answers"),
        # Patch 0021: the snapshot file stayed locked, the engine answered its last read.
        (
            200,
            json.dumps(
                {"loads": [dict(PREFILL_ROOM_INFLIGHT, stale=1, snapshot_age_s=12.34)]}
            ).encode(),
            "GET /v1/loads: stale: the scheduler holds its snapshot file locked (stopped or "
            "wedged while publishing?); the last snapshot read is 12.3 s old",
        ),
    ],
)
def test_read_sends_the_key_and_says_what_was_wrong(status, body, expected):
    server = _Server(status, body)
    try:
        got = loads.read(server.url, api_key="k")
    finally:
        server.httpd.shutdown()
    assert server.auth == "Bearer k"
    assert got == (expected if expected is not None else [PREFILL_ROOM_INFLIGHT])
