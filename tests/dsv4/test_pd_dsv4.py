"""env/cpu-dsv4-tp: a tiny DeepSeek-V4 in PD on real CPU engines, prefill at TP 1 and decode at
TP 2, over NIXL, behind the real smg.

The stack comes up with launch/pd from a copy of env/cpu-dsv4-tp (free loopback ports, its own
run directory). Greedy tokens through the router must equal bench/dsv4_check's in-process tokens
for the same prompt: every row decode's two ranks read arrived over NIXL from prefill's one rank
(patches 0007 and 0017; before 0017 registered the state buffers under NIXL's host-memory device
id, the first state transfer to rank 1 failed with NIXL_ERR_NOT_FOUND). Decode's log must show
the mma kernel's decode launches with the env file's split target, and `launch/pd verify` must
read the knobs in each decode rank's process. `DSV4_PD_ENV=cpu-dsv4` runs the same tests with
decode at TP 1: every transfer path is also taken at TP 2 (by rank 0), so CI runs the TP 2 one.

The model is env/cpu-dsv4's, the c4c128 standard (a c4 layer with its indexer, a c128 layer).
Its 252-token prompt is longer than the 128-token window and fills compressed entries in
prefill: 63 c4 entries and their index keys, one c128 entry, and 124 rows of the c128 state ring
that decode needs when it closes the next window at 256 tokens. So the SWA rows, both compressed
pools, the indexer's keys and the compressor states must all arrive for the tokens to match.
`DSV4_PD_STANDARD=swa` runs the same tests on the SWA-only model (160-token prompt).

Then the faults of tests/engine, on this model (engine_harness holds the machinery): one decode
rank killed mid-stream (the engine must exit whole, not stay half alive with its other rank in a
collective) and a co-restart that also puts a changed split target live, prefill frozen
while decode waits (the room's pages quarantined until prefill acknowledges, patch 0024),
decode frozen after bootstrap. Each asserts on the engines' /metrics
counters and the client's error (which names the variable that bounded it), waits until both
engines hold nothing, and serves a fresh request. "Hold nothing" is read from /v1/loads
(launch/pdlib/loads.py): for a hybrid-SWA model its num_used_tokens is the larger of the full
and SWA pools' use (PoolStats.get_kv_token_stats), and the c4/c128 compressed pools, the
indexer's keys and the compressor states have no usage figure of their own: their rows are
addressed through a request's full and SWA allocations (the backend's page tables and the
state rings index by them), so they are free when those two are.

The copy runs with an API key, the router's retries off (a retry would hide an engine's
failure from the client), UCX on TCP only (tests/engine says why the frozen-decode fault needs
it) and prefill's inflight timeout at 10 s. Decode's waiting timeout stays at the env file's 300
s for the long prompt (it runs from decode's metadata send, so prefill's compute counts in it)
and goes to 10 s with the co-restart, before the faults; a fault test run alone sets it first.
"""

import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "engine"))

from engine_harness import (  # noqa: E402
    Stack,
    decode_frozen_after_bootstrap,
    kill_decode_mid_stream,
    pd,
    prefill_frozen,
    serves_a_fresh_request,
    start_fault_stack,
    stop_stack,
    wait_idle,
)

from bench import dsv4_check  # noqa: E402
from launch.pdlib import envfiles  # noqa: E402

STANDARD = os.environ.get("DSV4_PD_STANDARD", "c4c128")
ENV = os.environ.get("DSV4_PD_ENV", "cpu-dsv4-tp")
SWA_PROMPT, SWA_STEPS = 160, 6  # c4c128: conftest's session check (252 tokens, 6 steps)
# The faults' timeouts (seconds): decode's wait for a room's KV, prefill's for its KV sender.
# Decode's wait also bounds every healthy request here, and a short prompt's interpreted DSV4
# prefill took 11 s on 2 loaded cores, and over 20 s once with other tests running beside the
# suite (co-restart's probe failed on it): 30 s leaves room for that.
WAITING_TIMEOUT_S = 30
INFLIGHT_TIMEOUT_S = 10
LONG_WAITING_S = 300  # env/cpu-dsv4's decode.env, for the long prompt


@pytest.fixture(scope="module")
def model(c4c128_model, request) -> Path:
    if STANDARD == "swa":
        return request.getfixturevalue("swa_model")
    return c4c128_model


@pytest.fixture(scope="module")
def reference(model, request, tmp_path_factory) -> dict:
    """bench/dsv4_check's in-process mma run on the PD test's prompt: its prompt ids and
    tokens. Taken before the stack is up (the stack fixture depends on it)."""
    if STANDARD == "c4c128":
        got = request.getfixturevalue("c4c128_checked")
        return {"ids": got["prompt_ids"], "tokens": got["tokens"]["mma"]}
    cfg = json.loads((model / "config.json").read_text())
    ids = dsv4_check.prompt_ids(cfg, SWA_PROMPT, 1)
    out = tmp_path_factory.mktemp("reference") / "mma.pt"
    check = dsv4_check.run_backend("mma", model, ids, SWA_STEPS, None, out, 600)
    return {"ids": ids, "tokens": check["tokens"]}


@pytest.fixture(scope="module")
def dsv4_stack(model, reference, tmp_path_factory):
    cfg = json.loads((model / "config.json").read_text())
    small = {
        "input_ids": dsv4_check.prompt_ids(cfg, 16, 2),
        "sampling_params": {"temperature": 0, "max_new_tokens": 3},
    }
    stack = start_fault_stack(
        ENV,
        tmp_path_factory.mktemp(ENV),
        small,
        LONG_WAITING_S,
        INFLIGHT_TIMEOUT_S,
        {"MODEL_PATH": str(model)},
    )
    yield stack
    stop_stack(stack)


def test_greedy_through_pd_equals_the_in_process_check(model, reference, dsv4_stack):
    stack = dsv4_stack
    cfg = json.loads((model / "config.json").read_text())
    ids, steps = reference["ids"], len(reference["tokens"]) - 1
    assert ids == dsv4_check.prompt_ids(cfg, len(ids), 1)
    assert len(ids) > cfg["window_size"]
    if STANDARD == "c4c128":  # decode closes a c128 window from the ring prefill filled
        assert len(ids) < 256 <= len(ids) + steps
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": steps + 1}}
    through_pd = stack.post("/generate", body, timeout=300)["output_ids"]
    assert through_pd == reference["tokens"], (through_pd, reference["tokens"])
    decode_log = stack.log("decode")
    assert "SGLANG_CPU_SM120_PATH=1: this CPU scheduler takes the SM120 DSV4" in decode_log
    # env/cpu-dsv4's SGLANG_SM120_MMA_TARGET_CTAS=512 on decode, seen by the mma launcher.
    assert "SGLANG_SM120_MMA_TARGET_CTAS=512 (set): batch 1," in decode_log
    verify = pd(stack.env_dir, "verify", timeout=180)
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-2000:]
    # The knobs in each decode rank's own process (their titles are sglang's, kept off the
    # environment by the env file's SPT_NOENV=1), not only in the process that owns the port.
    titles = (
        ["sglang::scheduler"]
        if decode_tp(stack) == 1
        else ["sglang::scheduler_TP0", "sglang::scheduler_TP1"]
    )
    for title in titles:
        line = f"ok   decode SGLANG_SM120_MMA_TARGET_CTAS=512 live in {title} pid"
        assert line in verify.stdout, verify.stdout[-3000:]


def decode_tp(stack: Stack) -> int:
    return int(envfiles.EnvDir(stack.env_dir).role_env("decode")["TP_SIZE"])


def _co_restart_with(stack: Stack, decode_values: dict[str, str]) -> str:
    """decode.env changed, then `launch/pd co-restart`; returns its output."""
    envfiles.set_values(stack.env_dir / "decode.env", decode_values)
    # A 2-token probe: each token is an interpreted decode step (about 3 s at TP 2 here).
    done = pd(stack.env_dir, "co-restart", "--probe-max-tokens", "2", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    for key, value in decode_values.items():
        assert f"ok   decode {key}={value} live in pid" in done.stdout, done.stdout
    return done.stdout


def _short_waiting_timeout(stack: Stack) -> None:
    """The faults run with decode's waiting timeout at WAITING_TIMEOUT_S. In the module that is
    done by the co-restart test; a fault test run alone does it here."""
    if stack.waiting_s != WAITING_TIMEOUT_S:
        _co_restart_with(stack, {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S)})
        stack.waiting_s = WAITING_TIMEOUT_S


def test_decode_rank_killed_mid_stream_then_co_restart_puts_a_changed_split_target_live(dsv4_stack):
    """Decode's last rank (scheduler_TP1 at TP 2) killed while it streams: the client gets an
    error, not a finished stream, every process of the decode engine is gone within a minute
    (not half alive, its other rank waiting in a collective), and prefill holds nothing. Then
    the operator's loop on DSV4: SGLANG_SM120_MMA_TARGET_CTAS
    changed in decode.env (with the faults' waiting timeout) and `co-restart` (each role in
    order, health-gated, then verify): the new value is live in decode's process and in the mma
    launcher's split choice for the next request, which the restarted stack serves. /metrics:
    prefill counted the killed request's prompt, and the new decode the new request's tokens."""
    stack = dsv4_stack
    prompt_before = stack.metrics("prefill").get("sglang:prompt_tokens_total", 0.0)
    body = {**stack.body, "sampling_params": {"temperature": 0, "max_new_tokens": 64}}
    kill_decode_mid_stream(stack, body, kill_after=3, stream_s=120, one_rank=True)
    prompt_after = stack.metrics("prefill")["sglang:prompt_tokens_total"]
    assert prompt_after >= prompt_before + len(body["input_ids"])
    log = stack.run_dir / "decode.log"
    offset = len(log.read_text())
    out = _co_restart_with(
        stack,
        {
            "SGLANG_SM120_MMA_TARGET_CTAS": "64",
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S),
        },
    )
    stack.waiting_s = WAITING_TIMEOUT_S
    assert "co-restart done in" in out, out
    serves_a_fresh_request(stack)
    wait_idle(stack, "prefill")
    wait_idle(stack, "decode")
    assert stack.metrics("decode")["sglang:generation_tokens_total"] >= stack.out_len
    text = log.read_text()
    since = text[offset:] if len(text) >= offset else text  # appended, or a fresh log
    # The restarted decode's launches (the probe's and this request's) use the new target.
    assert "SGLANG_SM120_MMA_TARGET_CTAS=64 (set): batch 1," in since
    assert "SGLANG_SM120_MMA_TARGET_CTAS=512" not in since


def test_prefill_frozen_decode_fails_the_room_after_its_waiting_timeout(dsv4_stack):
    """Prefill's scheduler stopped: decode fails the DSV4 room after its waiting timeout (the
    client's error names the variable) and its failed-transfer counter counts it. Past the
    deferred-release timeout the room's pages (full and SWA pools, and the compressed, indexer
    and state rows addressed through them) stay quarantined while prefill is stopped (patch
    0024: decode's log and gauges, /v1/loads' tokens in use); once prefill runs again and
    acknowledges the abort they are released, both engines come back to holding nothing, and a
    fresh request is served."""
    _short_waiting_timeout(dsv4_stack)
    prefill_frozen(dsv4_stack)


def test_decode_frozen_after_bootstrap_prefill_fails_after_the_inflight_timeout(dsv4_stack):
    """Decode stopped after bootstrapping the DSV4 room: prefill's KV send (the SWA, compressed,
    indexer and state buffers) never concludes, patch 0003 fails it after the inflight timeout
    (counted on prefill's /metrics, named in the client's error), and both engines come back to
    holding nothing (engine_harness.decode_frozen_after_bootstrap)."""
    _short_waiting_timeout(dsv4_stack)
    started = time.monotonic()
    decode_frozen_after_bootstrap(dsv4_stack)
    print(f"decode frozen after bootstrap: {time.monotonic() - started:.0f} s")
