"""Real sglang engines on CPU through the normal launch path: env/cpu, patches 0006 to 0009.

One real stack per module (prefill and decode are `python -m sglang.launch_server` from our
patched wheel on the CPU, KV moving between them over NIXL on loopback, the real smg router in
front), started with `launch/pd --env-dir COPY up` from a copy of env/cpu on free loopback ports,
with an API key, small PD timeouts so the fault tests end in seconds, and UCX on TCP only. The
router's retries are off in the copy: a retry would hide an engine's failure from the client,
and these tests look at what the engines do. The tests run in file order: the fault tests come
after the smoke tests, and the last ones restart and stop the stack.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import k8s_kubelet
import psutil
import pytest
import yaml
from engine_harness import (
    POST_ERROR_FAULT,
    ROOT,
    Call,
    NodeExporter,
    Prometheus,
    decode_frozen_after_bootstrap,
    decode_killed_while_prefill_stopped_mid_transfer,
    kill_decode_mid_stream,
    loads_files_in_shm,
    loads_files_left,
    loads_files_of,
    multiround,
    pd,
    post_error_room_drained,
    prefill_frozen_mid_transfer,
    prefill_restarted_while_quarantined,
    ready,
    resume,
    serves_a_fresh_request,
    start_fault_stack,
    stop_stack,
    suspend,
    wait_for,
    wait_idle,
    wait_router_healthy,
)
from prometheus_client.parser import text_string_to_metric_families

from launch.pdlib import envfiles, k8s, k8s_schema, loads, maintenance, monitoring, wedged
from launch.pdlib.stack import free_loopback_ports, load_stack
from launch.pdlib.stack import http as http_get

# Seconds decode waits for a room's KV, and prefill for its KV sender, in the test copy.
WAITING_TIMEOUT_S = 10
INFLIGHT_TIMEOUT_S = 10
# Seconds a room may wait in a PD queue before its alert fires (monitoring --queue-after).
QUEUE_AFTER_S = 4
# sglang's CPU engine flags, as env/cpu gives them, for the standalone engine.
CPU_FLAGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--sampling-backend",
    "pytorch",
    "--max-total-tokens",
    "16384",
]
# The sglang load snapshot files in /dev/shm before the stack went up (other engines' included).
LOADS_FILES_BEFORE_UP: set[str] = set()
# Greedy output ids of GREEDY through the PD stack, compared with a standalone engine at the end.
THROUGH_PD: dict[str, list[int]] = {}
GREEDY = {
    "text": "hello world the quick brown fox",
    "sampling_params": {"max_new_tokens": 12, "temperature": 0},
}
# Late writes into reused pages (patch 0024). Prefill sends in chunks of 128 tokens, so the long
# room is stopped after its first of 19. Decode admits a room when its free KV covers the prompt
# plus sglang's 512 tokens reserved for decoding: in a pool of 3072 the long room (2400 tokens)
# fits, and while it is held only 672 tokens are free, less than the second request (900 + 512)
# needs; once the room's pages are released the second request must take some of them (its
# 900 tokens do not fit in the 672 that were free). The prompts are plain token ids.
STACK_ARGS = {"prefill": "--chunked-prefill-size 128", "decode": "--max-total-tokens 3072"}
# Patch 0033's bound in the test copy (env/cpu keeps the default, 30 s). Decode's is short, so
# the wedged test sees decode leave the router's rotation soon; busy, on 2 loaded cores, a
# scheduler here went up to 5.6 s without publishing, so it is not shorter. Prefill's is above
# the longest time the late-write tests hold its scheduler stopped (its waiting timeout, the
# deferred release and the quarantine, about 40 s) while a second request must still reach
# decode through the router.
STALL_BOUND = "SGLANG_HEALTH_SCHEDULER_STALL_S"
# Patch 0025's fault point: while the file it names exists, every PD queue gauge refresh fails.
QUEUE_METRICS_FAULT = "SM120PD_FAULT_PD_QUEUE_METRICS_FILE"
STALL_BOUND_S = {"decode": 15, "prefill": 120}
LONG_ROOM = {
    "input_ids": [2 + (7 * i) % 400 for i in range(2400)],
    "sampling_params": {"max_new_tokens": 8, "temperature": 0},
}
SECOND_ROOM = {
    "input_ids": [2 + (11 * i + 5) % 400 for i in range(900)],
    "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def cpu_stack(tmp_path_factory):
    model = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_tiny_model.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert model.returncode == 0, model.stderr[-3000:]
    LOADS_FILES_BEFORE_UP.update(loads_files_in_shm())
    tmp = tmp_path_factory.mktemp("cpu-stack")
    # node_exporter's textfile directory: launch/pd's maintenance marks, verify's results.
    (tmp / "textfile").mkdir()
    stack = start_fault_stack(
        "cpu",
        tmp,
        GREEDY,
        WAITING_TIMEOUT_S,
        INFLIGHT_TIMEOUT_S,
        common={
            maintenance.VARIABLE: str(tmp / "textfile"),
            POST_ERROR_FAULT: str(tmp / "fault"),
            QUEUE_METRICS_FAULT: str(tmp / "queue-metrics-fault"),
        },
        args=STACK_ARGS,
        role_env={role: {STALL_BOUND: str(bound)} for role, bound in STALL_BOUND_S.items()},
    )
    yield stack
    stop_stack(stack)


def textfiles(stack) -> Path:
    return Path(envfiles.EnvDir(stack.env_dir).common()[maintenance.VARIABLE])


@pytest.fixture(scope="module")
def prometheus(cpu_stack, tmp_path_factory):
    """A real Prometheus on the stack, with what `launch/pd monitoring` renders for it, and a
    real node exporter reading the stack's PD_TEXTFILE_DIR: every target scraped and every rule
    evaluated each second, an instance down after 3 s, requests stuck before idle engines
    after 5 s, a scheduler stalled after 8 s, a room in a PD queue for QUEUE_AFTER_S (below
    the engines' own 10 s timeouts, so that while a fault holds a room only the alert can
    report it), a crash loop within 40 s, a verify result older than 15 s (the defaults are
    minutes)."""
    tmp = tmp_path_factory.mktemp("prometheus")
    exporter = NodeExporter(textfiles(cpu_stack), tmp / "node-exporter.log")
    prom = Prometheus(
        cpu_stack,
        tmp,
        *("--scrape-interval", "1", "--down-after", "3", "--stuck-after", "5"),
        *("--stalled-after", "8", "--queue-after", f"{QUEUE_AFTER_S:g}", "--held-after", "3"),
        *("--flap-window", "40", "--verify-stale-after", "15", "--quarantine-after", "2"),
        *("--textfile-target", exporter.target),
    )
    yield prom
    prom.stop()
    exporter.stop()


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_the_api_key_is_on_no_command_line_and_in_private_files_only(cpu_stack):
    everyone = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True)
    assert everyone.returncode == 0
    assert cpu_stack.key not in everyone.stdout
    # The engines read it from sglang --config files, the router through smg_keyfile.py.
    for role in ("prefill", "decode"):
        argv = psutil.Process(cpu_stack.pid(role)).cmdline()
        assert "--config" in argv and "--api-key" not in argv, argv
    secrets_dir = cpu_stack.run_dir / "secrets"
    assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
    assert sorted(p.name for p in secrets_dir.iterdir()) == [
        "decode.yaml",
        "prefill.yaml",
        "router.key",
    ]
    for path in [*secrets_dir.iterdir(), *cpu_stack.run_dir.glob("*.log")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # The run dir is the user's alone, and the server_args line sglang logs at start-up names
    # the key redacted (patch 0009), so no log holds it.
    assert stat.S_IMODE(cpu_stack.run_dir.stat().st_mode) == 0o700
    for role in ("prefill", "decode"):
        log = (cpu_stack.run_dir / f"{role}.log").read_text(errors="replace")
        assert "'api_key': '<redacted>'" in log, log[-2000:]
    for path in cpu_stack.run_dir.glob("*.log"):
        assert cpu_stack.key not in path.read_text(errors="replace"), path
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(
            urllib.request.Request(
                cpu_stack.url["decode"] + "/generate",
                json.dumps(GREEDY).encode(),
                {"content-type": "application/json"},
            ),
            timeout=30,
        )
    assert refused.value.code == 401


def test_verify_reads_the_real_engines_processes_and_manifest(cpu_stack):
    done = pd(cpu_stack.env_dir, "verify", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for role in ("prefill", "decode"):
        assert f"ok   {role} SGLANG_USE_CPU_ENGINE=1 live in pid" in done.stdout
    assert "ok   decode SGLANG_SM120_MMA_TARGET_CTAS=512 live in pid" in done.stdout
    assert "patched build" in done.stdout and "FAIL" not in done.stdout


def test_nixls_threads_run_at_the_env_files_nice_value(cpu_stack):
    """env/cpu's SGLANG_DISAGGREGATION_NIXL_THREAD_NICE=19 (patch 0020): each engine's
    scheduler logged the NIXL threads it lowered, those still running are at nice 19, and the
    scheduler's own thread is not."""
    for role in ("prefill", "decode"):
        logged = re.findall(
            r"SGLANG_DISAGGREGATION_NIXL_THREAD_NICE=19: (\d+) NIXL native thread\(s\) at nice 19 "
            r"\(thread ids ([\d, ]+)\)",
            cpu_stack.log(role),
        )
        assert logged, cpu_stack.log(role)[-2000:]
        count, ids = logged[-1]
        tids = [int(t) for t in ids.split(", ")]
        assert int(count) == len(tids) >= 1
        (scheduler,) = cpu_stack.schedulers(role)
        # Some of them end once the backend is up; NIXL's progress thread stays.
        live = set(tids) & {t.id for t in scheduler.threads()}
        assert live, (role, tids)
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in live} == {19}
        assert os.getpriority(os.PRIO_PROCESS, scheduler.pid) == 0


def test_probe_through_the_router(cpu_stack):
    done = pd(cpu_stack.env_dir, "probe", timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr


# Holds LOCK_EX on the files named on its command line, as a scheduler stopped while it publishes
# its load snapshot does, until a line arrives on stdin.
LOCK_HOLDER = r"""
import fcntl, os, sys
fds = [os.open(path, os.O_RDWR) for path in sys.argv[1:]]
for fd in fds:
    fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_held_snapshot_lock_blocks_no_route_of_either_engine(cpu_stack):
    """Patch 0021. Another process holds LOCK_EX on both engines' load snapshot files, as a
    scheduler stopped while it publishes holds it. /v1/loads, /health and /metrics of both
    engines each answer within 2 s: /v1/loads with the last snapshot read, marked stale and
    aged, which launch/pd's reader refuses as a state. Released, /v1/loads is fresh again.
    Before the patch no route of either engine answered while the lock was held."""
    files = {role: cpu_stack.snapshot_file(role) for role in ("prefill", "decode")}
    for role in files:
        assert "stale" not in cpu_stack.loads(role)[0]  # read once, unlocked
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, *files.values()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    took: dict[str, float] = {}
    answers: dict[str, tuple[int | None, bytes]] = {}
    try:
        assert holder.stdout.readline().strip() == "held"
        for role in files:
            for path in ("/v1/loads", "/health", "/metrics"):
                started = time.monotonic()
                try:
                    with cpu_stack.request(cpu_stack.url[role] + path, timeout=2) as resp:
                        answers[f"{role} {path}"] = (resp.status, resp.read())
                except OSError as err:
                    answers[f"{role} {path}"] = (None, repr(err).encode())
                took[f"{role} {path}"] = time.monotonic() - started
        refused = {role: loads.read(cpu_stack.url[role], cpu_stack.key) for role in files}
    finally:
        holder.communicate("\n", timeout=30)
    print({where: f"{seconds:.3f} s" for where, seconds in took.items()})
    assert {where: status for where, (status, _) in answers.items()} == dict.fromkeys(answers, 200)
    assert max(took.values()) < 2.0, took
    for role in files:
        (stale,) = json.loads(answers[f"{role} /v1/loads"][1])["loads"]
        assert stale["stale"] == 1 and stale["snapshot_age_s"] >= 0, stale
        assert refused[role].startswith("GET /v1/loads: stale: "), refused[role]
        assert "stale" not in cpu_stack.loads(role)[0]


def test_a_request_is_prefilled_on_one_engine_and_decoded_on_the_other(cpu_stack):
    prompt_before = cpu_stack.metrics("prefill").get("sglang:prompt_tokens_total", 0.0)
    gen_before = cpu_stack.metrics("decode").get("sglang:generation_tokens_total", 0.0)
    first = cpu_stack.post("/generate", GREEDY)
    second = cpu_stack.post("/generate", GREEDY)
    assert len(first["output_ids"]) == 12
    assert first["output_ids"] == second["output_ids"]
    THROUGH_PD["first stack"] = first["output_ids"]
    assert cpu_stack.metrics("prefill")["sglang:prompt_tokens_total"] > prompt_before
    assert cpu_stack.metrics("decode")["sglang:generation_tokens_total"] >= gen_before + 2 * 11


# tools/make_tiny_model.py's vocabulary, read from the model's own config by the test.
def tiny_vocab() -> int:
    return json.loads((ROOT / "build" / "tiny-llama" / "config.json").read_text())["vocab_size"]


def bad_requests(vocab: int, model: str) -> list[tuple[str, dict, str]]:
    """([ROLE ]PATH, body, what the 400 must say) for each form of a request that ended an
    engine on env/cpu before patch 0031, sent to the router or to ROLE's engine directly: ids
    past the embedding table, negative, inside the table's padding (answered before from a row
    no token owns), in a batch, streamed (answered 200 and an error event with code 400,
    sglang's streaming contract), through OpenAI completions (a prompt of ids, a batch of
    them), an empty text, and two logprob arguments."""
    rng = f"valid range is [0, {vocab})"

    def gen(**body) -> dict:
        return {"sampling_params": {"max_new_tokens": 2}, **body}

    def completion(prompt) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": 2}

    logprobs = {"input_ids": [5, 6], "return_logprob": True}
    return [
        ("/generate", gen(input_ids=[5, 899]), f"899 at position 1; {rng}"),
        ("/generate", gen(input_ids=[5, 6, -1]), f"-1 at position 2; {rng}"),
        ("/generate", gen(input_ids=[vocab + 7]), f"{vocab + 7} at position 0; {rng}"),
        ("/generate", gen(input_ids=[[5, 6], [7, 900]]), f"900 at position 1; {rng}"),
        ("/generate", gen(input_ids=[5, 901], stream=True), f"901 at position 1; {rng}"),
        ("/generate", gen(text=""), "The prompt has no tokens"),
        ("/generate", gen(**logprobs, top_logprobs_num=10000), f"vocabulary's {vocab} tokens"),
        ("/generate", gen(**logprobs, logprob_start_len=-7), "logprob_start_len must be -1"),
        # smg 1.13 refuses a prompt of token ids itself (its StringOrArray takes a string or
        # strings); the engines take one, so each form is also sent to an engine directly.
        ("/v1/completions", completion([5, 899]), "StringOrArray"),
        ("/v1/completions", completion([[5, 6], [902, 7]]), "StringOrArray"),
        ("prefill /v1/completions", completion([5, 899]), f"899 at position 1; {rng}"),
        ("decode /v1/completions", completion([[5, 6], [902, 7]]), f"902 at position 0; {rng}"),
    ]


def engine_processes(stack) -> dict[str, list[tuple[int, float]]]:
    """Each engine's processes (pid, start time): the same after a request means it survived."""
    found = {}
    for role in ("prefill", "decode"):
        main = psutil.Process(stack.pid(role))
        found[role] = sorted((p.pid, p.create_time()) for p in [main, *main.children(True)])
    return found


def test_a_request_no_scheduler_can_serve_is_refused_400_and_every_engine_serves_on(cpu_stack):
    """Patch 0031 through the router: each bad form is answered 400 naming the id, its position
    and the vocabulary's range (or the argument), the engines' processes are the same ones
    afterwards, and they serve the same greedy tokens as before. Without the patch the first
    request ended prefill (IndexError in the embedding lookup) and the router answered 503."""
    ready(cpu_stack)
    before = engine_processes(cpu_stack)
    greedy = cpu_stack.post("/generate", GREEDY)["output_ids"]
    # The model name launch/pd's probe sends (the engines serve it under this name).
    model = envfiles.EnvDir(cpu_stack.env_dir).common().get("SERVED_MODEL_NAME") or "default"
    wrong = []
    for target, body, says in bad_requests(tiny_vocab(), model):
        role, _, path = target.rpartition(" ")
        try:
            with cpu_stack.request(cpu_stack.url[role or "router"] + path, body, 60) as resp:
                status, text = resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode(errors="replace")
        if body.get("stream"):
            refused = status == 200 and '"code":400' in text.replace(" ", "")
        else:
            refused = status == 400
        if not (refused and says in text):
            wrong.append((target, body, status, text[:400]))
    assert not wrong, wrong
    assert engine_processes(cpu_stack) == before
    assert cpu_stack.post("/generate", GREEDY)["output_ids"] == greedy


def test_multiround_4x6_through_the_router(cpu_stack):
    done = multiround(
        cpu_stack,
        *("--sessions", "4", "--rounds", "6", "--max-tokens", "16"),
        *("--first-words", "40", "--turn-words", "10"),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "24/24 rounds ok" in done.stdout


def listening_sockets(pid: int) -> list[tuple[int, str, str, int, str]]:
    """(pid, process, address, port, protocol) of every socket that the process and its
    descendants listen on: TCP in LISTEN, UDP bound without a peer. Read here with psutil,
    apart from verify's own reading (launch/pdlib/listeners.py)."""
    top = psutil.Process(pid)
    found = []
    for proc in [top, *top.children(recursive=True)]:
        for conn in proc.net_connections("inet"):
            if conn.type == socket.SOCK_STREAM and conn.status == psutil.CONN_LISTEN:
                found.append((proc.pid, proc.name(), conn.laddr.ip, conn.laddr.port, "tcp"))
            elif conn.type == socket.SOCK_DGRAM and not conn.raddr:
                found.append((proc.pid, proc.name(), conn.laddr.ip, conn.laddr.port, "udp"))
    return found


def test_every_listening_socket_of_the_stack_is_on_its_configured_host(cpu_stack):
    """Every process of the stack (each engine's HTTP server, its scheduler, where NIXL and UCX
    run and torch.distributed's rendezvous store lives, and its detokenizer; smg) listens on
    127.0.0.1, the host env/cpu gives all three, and verify's listen layer says so. Before
    patch 0023 each scheduler's rendezvous store listened on `::` (every interface), and before
    launch/router.sh passed --prometheus-host, smg's Prometheus endpoint on 0.0.0.0."""
    env = envfiles.EnvDir(cpu_stack.env_dir).common()
    found = {role: listening_sockets(cpu_stack.pid(role)) for role in ("prefill", "decode")}
    found["router"] = listening_sockets(cpu_stack.pid("router"))
    print({role: [s[1:] for s in sockets] for role, sockets in found.items()})
    off = {role: [s for s in sockets if s[2] != "127.0.0.1"] for role, sockets in found.items()}
    assert not any(off.values()), off
    # Not a vacuous pass: the ports the env files name are there, on the processes launch/pd
    # started, and each scheduler listens too (UCX's TCP transport, the rendezvous store).
    ports = {role: {s[3] for s in sockets} for role, sockets in found.items()}
    assert {int(env["PREFILL_PORT"]), int(env["PREFILL_BOOTSTRAP_PORT"])} <= ports["prefill"]
    assert int(env["DECODE_PORT"]) in ports["decode"]
    assert ports["router"] == {int(env["ROUTER_PORT"]), int(env["ROUTER_PROMETHEUS_PORT"])}
    for role in ("prefill", "decode"):
        (scheduler,) = cpu_stack.schedulers(role)
        assert any(s[0] == scheduler.pid for s in found[role]), found[role]
    done = pd(cpu_stack.env_dir, "verify", timeout=120)
    for role in ("prefill", "decode", "router"):
        assert f"ok   {role} listens only on {role.upper()}_HOST=127.0.0.1: " in done.stdout, (
            done.stdout
        )


# Three prompts whose greedy tokens differ, so that a request answered with another's KV shows.
ROOM_PROMPTS = (GREEDY["text"], "one two three four five six", "a b c d e f g")
CLIENT_ROOM = 424242


def test_client_chosen_bootstrap_rooms_stay_the_routers(cpu_stack):
    """Two concurrent requests through the router carry the same client-chosen bootstrap_room,
    a third room 0. Each must get its own prompt's greedy tokens (those it gets alone, without
    a room), or a 4xx that names the room: the router, not the client, pairs a prefill with a
    decode. Had smg passed the client's room on, prefill and decode would hold two requests
    under one room. smg 1.13 serves all three; this guards an smg upgrade that changes it."""
    alone = []
    for text in ROOM_PROMPTS:
        body = {"text": text, "sampling_params": GREEDY["sampling_params"]}
        alone.append(cpu_stack.post("/generate", body)["output_ids"])
    assert len({tuple(ids) for ids in alone}) == len(ROOM_PROMPTS), alone

    def call(text: str, room: int) -> tuple[int, str]:
        body = {"text": text, "sampling_params": GREEDY["sampling_params"], "bootstrap_room": room}
        try:
            with cpu_stack.request(cpu_stack.url["router"] + "/generate", body, 120) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    rooms = (CLIENT_ROOM, CLIENT_ROOM, 0)
    with ThreadPoolExecutor(max_workers=len(rooms)) as pool:
        answers = list(pool.map(call, ROOM_PROMPTS, rooms))
    for (status, text), want, room in zip(answers, alone, rooms, strict=True):
        if 400 <= status < 500:
            assert "room" in text, (room, status, text)
        else:
            assert status == 200, (room, status, text)
            assert json.loads(text)["output_ids"] == want, (room, text)


def test_monitoring_reads_only_names_the_live_stack_exports(cpu_stack, prometheus, tmp_path):
    """Every metric name in the rendered rules and dashboard is in a live scrape of the real
    engines and smg (after one request), or in what `launch/pd verify --textfile` and launch/pd's
    maintenance marks write; the real Prometheus scrapes every target and evaluates every rule
    without an error. With no verify result yet PDVerifyStale fires, and a verify run resolves
    it; the targets' `worker` labels equal the router's own; a job left without targets fires
    PDTargetsAbsent."""
    # No verify result has reached Prometheus yet: absent is stale.
    prometheus.wait_firing("PDVerifyStale", 30)
    serves_a_fresh_request(cpu_stack)
    textfile = textfiles(cpu_stack) / "sm120pd_verify.prom"
    done = pd(cpu_stack.env_dir, "verify", "--textfile", str(textfile), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    prometheus.wait_resolved("PDVerifyStale", 30)
    marks = maintenance.textfile(load_stack(cpu_stack.env_dir, sim=False))
    prom_port = envfiles.EnvDir(cpu_stack.env_dir).common()["ROUTER_PROMETHEUS_PORT"]
    texts = [textfile.read_text(), marks.read_text()]
    for url in (cpu_stack.url["prefill"], cpu_stack.url["decode"], f"http://127.0.0.1:{prom_port}"):
        with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
            texts.append(resp.read().decode())
    scraped = {
        sample.name
        for text in texts
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    used: dict[str, set[str]] = {}
    rules = yaml.safe_load((prometheus.dir / "rules.yml").read_text())["groups"][0]["rules"]
    for rule in rules:
        used[rule["alert"]] = monitoring.metric_names(rule["expr"])
    board = json.loads((prometheus.dir / "dashboard.json").read_text())
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            used[panel["title"]] = used.get(panel["title"], set()) | monitoring.metric_names(
                target["expr"]
            )
    assert all(used.values()), used
    missing = {where: names - scraped - {"up"} for where, names in used.items()}
    assert not any(missing.values()), {k: v for k, v in missing.items() if v}
    wait_for(
        lambda: {t["health"] for t in prometheus.api("targets")["activeTargets"]} == {"up"},
        30,
        "every target up",
        lambda: [
            (t["labels"]["job"], t["lastError"]) for t in prometheus.api("targets")["activeTargets"]
        ],
    )
    assert len(prometheus.api("targets")["activeTargets"]) == 4
    evaluated = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    assert len(evaluated) == len(rules)
    assert {(r["health"], r.get("lastError", "")) for r in evaluated} == {("ok", "")}
    # PDInstanceNotRouted's join: each engine target's `worker` is a worker smg lists healthy.
    joined = prometheus.query(
        'up{job=~"sm120pd-cpu-(prefill|decode)"} == 1 '
        'and on(worker) (smg_worker_health{job="sm120pd-cpu-router"} == 1)'
    )
    assert sorted(r["metric"]["pd_instance"] for r in joined) == ["decode", "prefill"], joined
    # Every instance marked in service by `up`, as the rules read the marks.
    in_service = prometheus.query(f'{maintenance.METRIC}{{stack="sm120pd-cpu"}} == 0')
    assert sorted(r["metric"]["pd_instance"] for r in in_service) == [
        "decode",
        "prefill",
        "router",
    ]
    # The router's job without a target: absent, then back.
    router_targets = prometheus.dir / "targets" / "router.json"
    kept = router_targets.read_text()
    router_targets.write_text("[]\n")
    try:
        absent = prometheus.wait_firing("PDTargetsAbsent", 30, pd_role="router")
    finally:
        router_targets.write_text(kept)
    print("alert:", json.dumps(absent, indent=1))
    assert "Job sm120pd-cpu-router has no target" in absent["annotations"]["description"]
    prometheus.wait_resolved("PDTargetsAbsent", 60, pd_role="router")


def queue_gauges(stack, role: str) -> dict[str, float]:
    """The engine's sglang:pd_queue_requests by queue, as its /metrics serves them."""
    with stack.request(stack.url[role] + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {
        sample.labels["queue"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in ("sglang:pd_queue_requests", "sglang_pd_queue_requests")
    }


def test_a_failing_queue_gauge_refresh_reads_nan_and_fires_its_alert(cpu_stack, prometheus):
    """Patch 0025's fault point on both engines: while its file exists every refresh of the PD
    queue gauges fails. The gauges read NaN on each engine's /metrics instead of their last
    values, PDQueueMetricsFailing fires for decode (and prefill), and the stack still serves.
    The file removed, the next refresh sets numbers again and the alert resolves. Before, one
    error switched the gauges off for the life of the process, their last values standing."""
    fault = Path(envfiles.EnvDir(cpu_stack.env_dir).common()[QUEUE_METRICS_FAULT])
    ready(cpu_stack)
    assert queue_gauges(cpu_stack, "decode")["waiting"] == 0
    fault.touch()
    try:
        fired = prometheus.wait_firing("PDQueueMetricsFailing", 60, pd_instance="decode")
        failing = queue_gauges(cpu_stack, "decode")
        served = cpu_stack.post("/generate", GREEDY)
    finally:
        fault.unlink(missing_ok=True)
    print("alert:", json.dumps(fired, indent=1))
    assert failing and all(math.isnan(v) for v in failing.values()), failing
    assert len(served["output_ids"]) == 12
    assert "PD queue metrics not refreshed" in cpu_stack.log("decode")
    wait_for(
        lambda: queue_gauges(cpu_stack, "decode")["waiting"] == 0,
        30,
        "decode's queue gauges refreshed again",
        lambda: queue_gauges(cpu_stack, "decode"),
    )
    prometheus.wait_resolved("PDQueueMetricsFailing", 60, pd_instance="decode")
    assert "PD queue metrics refreshed again" in cpu_stack.log("decode")


def firing_value(alert: dict) -> float:
    return float(alert["value"])


def verify_into_textfiles(stack) -> subprocess.CompletedProcess:
    path = textfiles(stack) / "sm120pd_verify.prom"
    return pd(stack.env_dir, "verify", "--textfile", str(path), timeout=120)


def test_knob_drift_fires_from_a_verify_result_and_a_stale_result_fires_later(
    cpu_stack, prometheus
):
    """The env files say one SGLANG_SM120_MMA_TARGET_CTAS, decode's process holds another: the
    verify result that node_exporter serves fires PDKnobDrift for that instance and variable,
    and not PDVerifyCheckFailed. Verified again as it runs, it resolves; with no newer result,
    PDVerifyStale fires once that one is older than --verify-stale-after."""
    decode_env = cpu_stack.env_dir / "decode.env"
    before = decode_env.read_text()
    try:
        envfiles.set_values(decode_env, {"SGLANG_SM120_MMA_TARGET_CTAS": "256"})
        drifted = verify_into_textfiles(cpu_stack)
        drift = prometheus.wait_firing("PDKnobDrift", 30, pd_instance="decode")
        failed = prometheus.alerts("PDVerifyCheckFailed")
    finally:
        decode_env.write_text(before)
    print("alert:", json.dumps(drift, indent=1))
    assert drifted.returncode == 1, drifted.stdout + drifted.stderr
    assert drift["labels"]["variable"] == "SGLANG_SM120_MMA_TARGET_CTAS"
    assert drift["labels"]["layer"] == "env"
    assert not failed, failed
    fixed = verify_into_textfiles(cpu_stack)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    verified_at = time.time()
    prometheus.wait_resolved("PDKnobDrift", 30)
    stale = prometheus.wait_firing("PDVerifyStale", 60)
    print("alert:", json.dumps(stale, indent=1))
    assert time.time() - verified_at >= 15
    assert stale["annotations"]["summary"].startswith(
        f"No recent launch/pd verify result for this stack. Run: {ROOT}/launch/pd verify "
    )


def test_prefill_stopped_mid_transfer_no_late_write_lands_in_reused_pages(cpu_stack, prometheus):
    """Prefill's scheduler alone stopped after it starts sending a long room: decode fails the
    room after SGLANG_DISAGGREGATION_WAITING_TIMEOUT and keeps its pages quarantined until
    prefill, running again, acknowledges the abort; a second request that needs those pages
    waits for them and then gets exactly its reference tokens and logprobs
    (engine_harness.prefill_frozen_mid_transfer). While the room waits in decode's transfer
    queue, PDDecodeTransferQueueStuck fires on its age; while its pages are quarantined and no
    request is anywhere, PDTokensHeldAfterTraffic fires (--held-after 3), and
    PDDecodeKVQuarantined fires on the room's time in the quarantine (--quarantine-after 2)
    and resolves once the room leaves it; while the second
    request waits in the prealloc queue and decode runs no step, PDDecodePreallocQueueStuck
    fires."""
    transfer = prometheus.watch("PDDecodeTransferQueueStuck", 300, pd_instance="decode")
    held: dict[str, dict] = {}

    def while_held() -> None:
        held["prealloc"] = prometheus.wait_firing(
            "PDDecodePreallocQueueStuck", 30, pd_instance="decode"
        )

    def while_quarantined() -> None:
        held["tokens"] = prometheus.wait_firing(
            "PDTokensHeldAfterTraffic", 30, pd_instance="decode"
        )
        held["quarantined"] = prometheus.wait_firing(
            "PDDecodeKVQuarantined", 30, pd_instance="decode"
        )

    prefill_frozen_mid_transfer(cpu_stack, LONG_ROOM, SECOND_ROOM, while_held, while_quarantined)
    stuck = transfer.result()
    print("alerts:", json.dumps([stuck, held["prealloc"], held["tokens"]], indent=1))
    assert firing_value(held["tokens"]) >= len(LONG_ROOM["input_ids"])
    assert firing_value(held["quarantined"]) > 2
    prometheus.wait_resolved("PDDecodeKVQuarantined", 30)
    assert stuck["labels"]["queue"] == "decode_transfer"
    assert QUEUE_AFTER_S < firing_value(stuck) < WAITING_TIMEOUT_S + 5
    assert firing_value(held["prealloc"]) > QUEUE_AFTER_S
    assert "ran no decode step" in held["prealloc"]["annotations"]["description"]
    prometheus.wait_resolved("PDDecodeTransferQueueStuck", 30)
    prometheus.wait_resolved("PDDecodePreallocQueueStuck", 30)


def test_a_room_whose_nixl_post_failed_is_acknowledged_once_prefill_proved_it_drained(cpu_stack):
    """Patch 0030 on real engines: a NIXL post error on prefill (the fault point the stack's
    common.env names), and decode frees the room's pages on prefill's acknowledgement, well
    before the deferred-release timeout (engine_harness.post_error_room_drained)."""
    fault = Path(envfiles.EnvDir(cpu_stack.env_dir).common()[POST_ERROR_FAULT])
    line = post_error_room_drained(cpu_stack, fault, cpu_stack.body)
    print(line)
    assert "fenced to" in line and "no decode agent" not in line


def test_decode_frozen_after_bootstrap_prefill_fails_after_the_inflight_timeout(
    cpu_stack, prometheus
):
    """Decode stops after bootstrapping the room: patch 0003 fails it after
    SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT (engine_harness.decode_frozen_after_bootstrap).
    Before that, while the room is pinned in prefill's inflight queue and nothing else runs,
    PDPrefillKVPinned fires on the room's age (patch 0025's gauge); upstream's inflight-queue
    gauge is printed next to it for comparison."""
    pinned = prometheus.watch("PDPrefillKVPinned", 300, pd_instance="prefill")
    decode_frozen_after_bootstrap(cpu_stack)
    alert = pinned.result()
    upstream = prometheus.query(
        'max_over_time({__name__=~"sglang[:_]num_prefill_inflight_queue_reqs",'
        'job="sm120pd-cpu-prefill"}[2m])'
    )
    print("alert:", json.dumps(alert, indent=1))
    print("upstream's inflight-queue gauge, highest in the last 2 minutes:", upstream)
    assert alert["labels"]["severity"] == "critical"
    assert QUEUE_AFTER_S < firing_value(alert) < INFLIGHT_TIMEOUT_S + 5
    assert alert["annotations"]["summary"].startswith(
        "A prefill room holds its KV past the inflight timeout. Run: "
        f"{ROOT}/launch/pd verify --env-dir {cpu_stack.env_dir.resolve()}"
    )
    prometheus.wait_resolved("PDPrefillKVPinned", 30)


def test_decode_wholly_frozen_triage_and_probe_name_it_unresponsive(cpu_stack, prometheus):
    """Decode's whole process group stopped (its HTTP server too) while a client runs
    bench/multiround through the router: the triage that the missed deadline runs, and
    launch/pd probe, name decode as the engine that did not answer, prefill as answering, and
    say how the router lists decode; Prometheus fires PDInstanceDown for decode. Thawed, the
    alert resolves, the room fails through the PD timeouts and the stack serves again."""
    group = cpu_stack.pid("decode")
    deadline_s = 5
    os.killpg(group, signal.SIGSTOP)
    try:
        client = multiround(
            cpu_stack,
            *("--sessions", "1", "--rounds", "1", "--max-tokens", "8"),
            *("--deadline-s", str(deadline_s)),
            timeout=120,
        )
        probe = pd(cpu_stack.env_dir, "probe", "--probe-timeout", "10", timeout=120)
        down = prometheus.wait_firing("PDInstanceDown", 30, pd_instance="decode")
        unanswered = verify_into_textfiles(cpu_stack)
        check_failed = prometheus.wait_firing("PDVerifyCheckFailed", 30, pd_instance="decode")
    finally:
        os.killpg(group, signal.SIGCONT)
    assert unanswered.returncode == 1
    assert check_failed["labels"]["layer"] == "health", check_failed
    assert not prometheus.alerts("PDKnobDrift")
    print("alert:", json.dumps(down, indent=1))
    assert down["labels"]["severity"] == "critical" and down["labels"]["pd_role"] == "decode"
    assert (
        f"launch/pd status --env-dir {cpu_stack.env_dir.resolve()}"
        in down["annotations"]["summary"]
    )
    assert not prometheus.alerts("PDInstanceDown", pd_instance="prefill")
    prometheus.wait_resolved("PDInstanceDown", 30, pd_instance="decode")
    # Twice more down and back, each too short for PDInstanceDown: a crash loop.
    for _ in range(2):
        os.killpg(group, signal.SIGSTOP)
        try:
            wait_for(lambda: decode_up(prometheus) == 0, 30, "Prometheus seeing decode down")
        finally:
            os.killpg(group, signal.SIGCONT)
        wait_for(lambda: decode_up(prometheus) == 1, 30, "Prometheus seeing decode back")
    flapping = prometheus.wait_firing("PDInstanceFlapping", 30, pd_instance="decode")
    print("alert:", json.dumps(flapping, indent=1))
    assert firing_value(flapping) >= monitoring.FLAP_CHANGES
    assert not prometheus.alerts("PDInstanceFlapping", pd_instance="prefill")
    verified = verify_into_textfiles(cpu_stack)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    prometheus.wait_resolved("PDVerifyCheckFailed", 30)
    out = client.stdout
    print(out, probe.stdout, sep="\n")
    assert client.returncode == 1, out + client.stderr
    assert "triage verdict: engine unresponsive" in out, out
    assert (
        f"because: decode ({cpu_stack.url['decode']}) did not answer: /metrics: no answer "
        f"within {deadline_s} s; /health: no answer within {deadline_s} s; prefill answered"
    ) in out, out
    assert "the router says:" in out and "  - decode: listed " in out, out
    assert probe.returncode == 1, probe.stdout + probe.stderr
    assert (
        f"verdict: engine unresponsive: decode ({cpu_stack.url['decode']}) did not answer: "
        "/metrics: no answer within 5 s; /health: no answer within 5 s; prefill answered"
    ) in probe.stdout, probe.stdout
    assert "router on decode: listed " in probe.stdout
    assert cpu_stack.key not in out + probe.stdout
    wait_idle(cpu_stack, "prefill", timeout_s=INFLIGHT_TIMEOUT_S + 30)
    wait_idle(cpu_stack, "decode", timeout_s=WAITING_TIMEOUT_S + 30)
    serves_a_fresh_request(cpu_stack)


def decode_up(prometheus) -> float | None:
    got = prometheus.query('up{job="sm120pd-cpu-decode"}')
    return float(got[0]["value"][1]) if got else None


def router_worker(stack, role: str) -> dict:
    (worker,) = [w for w in stack.router_workers() if w["url"] == stack.url[role]]
    return worker


def snapshot_age(stack, role: str) -> float:
    """How old the engine's load snapshot is, by the engine's own clock (0 when unread)."""
    reply = http_get(stack.url[role] + wedged.LOADS_PATH, timeout=5, api_key=stack.key)
    oldest = wedged.snapshot_from(reply.status, reply.body, reply.error, 5).oldest
    return oldest[1] if oldest else 0.0


def test_decode_scheduler_alone_stopped_is_named_wedged_by_triage_probe_and_the_alert(
    cpu_stack, prometheus
):
    """Decode's scheduler process alone stopped (SIGSTOP), its HTTP server running. Patch
    0033: once its load snapshot is older than the bound, /health answers 503 with the reason,
    smg (checks every 2 s, three failures) marks decode unhealthy, and a request through the
    router gets smg's own 503 at once instead of being sent to it; the exit takes under a
    minute (before the patch /health answered 200 and the router kept routing to it).
    Prometheus fires PDSchedulerStalled for decode and not for prefill; bench/triage and
    launch/pd probe read `scheduler wedged`, naming decode, the signals that stopped and for
    how long, not `idle` or `inconclusive`. Resumed (SIGCONT), the alert resolves, the same
    processes pass smg's checks again and serve the greedy tokens taken before the stop."""
    ready(cpu_stack)
    greedy = cpu_stack.post("/generate", GREEDY)["output_ids"]
    before = engine_processes(cpu_stack)
    schedulers = cpu_stack.schedulers("decode")
    suspend(schedulers)
    stopped = time.monotonic()
    try:
        wait_for(
            lambda: router_worker(cpu_stack, "decode")["is_healthy"] is False,
            60,
            "the router marking decode unhealthy",
            lambda: (router_worker(cpu_stack, "decode"), snapshot_age(cpu_stack, "decode")),
        )
        left_after = time.monotonic() - stopped
        call = Call(cpu_stack, GREEDY)
        call.start()
        call.join(30)
        assert not call.is_alive(), "the router held a request while decode was out"
        stalled = prometheus.wait_firing("PDSchedulerStalled", 60, pd_instance="decode")
        healthy = prometheus.alerts("PDSchedulerStalled", pd_instance="prefill")
        # The snapshot only ages while the scheduler is stopped: a condition that stays met.
        wait_for(
            lambda: snapshot_age(cpu_stack, "decode") >= wedged.WEDGED_AFTER_S,
            30,
            "decode's load snapshot aged past the wedged threshold",
        )
        health = http_get(cpu_stack.url["decode"] + "/health", timeout=5)
        triage = subprocess.run(
            [
                sys.executable,
                str(ROOT / "bench" / "triage"),
                *("--url", cpu_stack.url["router"], "--env-dir", str(cpu_stack.env_dir)),
                *("--probe-timeout-s", "5"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        probe = pd(cpu_stack.env_dir, "probe", "--probe-timeout", "5", timeout=120)
    finally:
        resume(schedulers)
    print("alert:", json.dumps(stalled, indent=1))
    print(triage.stdout, probe.stdout, sep="\n")
    print(f"decode left the rotation {left_after:.1f} s after its scheduler stopped")
    print(f"router's answer meanwhile: HTTP {call.status} in {call.took:.2f} s: {call.text}")
    assert left_after < 60
    assert call.status == 503 and call.took < 10, (call.status, call.took, call.text)
    assert "No available decode workers" in call.text, call.text
    assert health.status == 503, (health.status, health.body)
    assert b"scheduler of dp_rank 0 has not published its load snapshot for" in health.body
    assert not healthy, healthy
    assert stalled["labels"]["severity"] == "critical"
    assert stalled["annotations"]["summary"].endswith(
        f"bench/triage --env-dir {cpu_stack.env_dir.resolve()}; then "
        f"{ROOT}/launch/pd probe --env-dir {cpu_stack.env_dir.resolve()}"
    )
    assert "has added no idle or stage time" in stalled["annotations"]["description"]
    prometheus.wait_resolved("PDSchedulerStalled", 30, pd_instance="decode")
    out = triage.stdout
    assert triage.returncode == 0, out + triage.stderr
    assert "triage verdict: scheduler wedged" in out, out
    because = re.search(r"^because: (.*)$", out, re.M).group(1)
    assert because.startswith(
        f"decode ({cpu_stack.url['decode']}) answers over HTTP (/health: HTTP 503 in "
    ), because
    age = re.search(
        r"its load snapshot \(/v1/loads loads\[dp_rank 0\]\.timestamp\) was last refreshed "
        r"([\d.]+) s ago and unchanged over the 1 s window",
        because,
    )
    assert age and float(age.group(1)) >= wedged.WEDGED_AFTER_S, because
    assert "sglang:scheduler_stage_seconds_total stood at" in because, because
    assert because.endswith("prefill's scheduler runs"), because
    assert probe.returncode == 1, probe.stdout + probe.stderr
    assert (
        f"verdict: scheduler wedged: decode ({cpu_stack.url['decode']}) answers over HTTP "
        "(/health: HTTP 503) but its scheduler does not run: its load snapshot"
    ) in probe.stdout, probe.stdout
    assert cpu_stack.key not in out + probe.stdout
    wait_idle(cpu_stack, "prefill", timeout_s=INFLIGHT_TIMEOUT_S + 30)
    wait_idle(cpu_stack, "decode", timeout_s=WAITING_TIMEOUT_S + 30)
    wait_router_healthy(cpu_stack)
    assert cpu_stack.post("/generate", GREEDY)["output_ids"] == greedy
    assert engine_processes(cpu_stack) == before
    assert http_get(cpu_stack.url["decode"] + "/health", timeout=5).status == 200


def test_busy_engines_answer_health_and_stay_in_rotation(cpu_stack):
    """No false exit: while both engines serve a burst of long prompts (10 chunks of 128 on
    prefill, 8 requests 4 at a time), every /health of each engine answers 200, the router
    lists both healthy throughout, and the oldest load snapshot seen stays below both bounds."""
    ready(cpu_stack)
    bodies = [
        {"input_ids": [2 + (7 * i + j) % 400 for i in range(1280)], **{"sampling_params": {
            "max_new_tokens": 8, "temperature": 0}}}
        for j in range(8)
    ]  # fmt: skip
    done = threading.Event()
    seen: dict[str, list] = {"health": [], "router": [], "age": []}

    def watch():
        while not done.is_set():
            for role in ("prefill", "decode"):
                seen["health"].append((role, http_get(cpu_stack.url[role] + "/health", 5).status))
                seen["age"].append((snapshot_age(cpu_stack, role), role))
            seen["router"].append(all(w["is_healthy"] for w in cpu_stack.router_workers()))
            done.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(4) as pool:
            outputs = list(pool.map(lambda b: cpu_stack.post("/generate", b, 300), bodies))
    finally:
        done.set()
        watcher.join(30)
    took = time.monotonic() - started
    print(
        f"{len(bodies)} requests in {took:.1f} s; {len(seen['health'])} /health answers; "
        "oldest load snapshot seen: %.2f s (%s)" % max(seen["age"])
    )
    assert all(len(o["output_ids"]) == 8 for o in outputs)
    assert seen["health"] and all(status == 200 for _, status in seen["health"]), seen["health"]
    assert seen["router"] and all(seen["router"]), seen["router"]
    assert all(age < STALL_BOUND_S[role] for age, role in seen["age"]), max(seen["age"])


def test_requests_held_through_a_stalled_proxy_before_idle_engines_fire_the_alert(
    cpu_stack, prometheus
):
    """The router's calls to both engines go through bench/proxy, which passes its health checks
    and load polls and stalls every /generate: the router holds the client's request while
    neither engine has it. PDRequestsStuckBeforeIdleEngines fires; when the client gives up, the
    router lets go and the alert resolves. The router is then pointed at the engines again."""
    ready(cpu_stack)
    ports = free_loopback_ports(2)
    proxies = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "bench" / "proxy"),
                *("--listen", f"127.0.0.1:{port}", "--upstream", cpu_stack.url[role]),
                *("--stall-after", "0", "--only-path", "/generate"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role, port in zip(("prefill", "decode"), ports, strict=True)
    ]
    router_env = cpu_stack.env_dir / "router.env"
    before = router_env.read_text()
    client = http.client.HTTPConnection("127.0.0.1", int(cpu_stack.url["router"].rsplit(":", 1)[1]))
    try:
        for port in ports:
            wait_for(lambda port=port: port_open(port), 30, f"bench/proxy on {port}")
        # The router's worker URLs only: the engines stay where they are.
        envfiles.set_values(
            router_env, {"PREFILL_PORT": str(ports[0]), "DECODE_PORT": str(ports[1])}
        )
        moved = pd(cpu_stack.env_dir, "restart", "router", timeout=120)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        headers = {"content-type": "application/json", "authorization": f"Bearer {cpu_stack.key}"}
        client.request("POST", "/generate", json.dumps(cpu_stack.body), headers)
        stuck = prometheus.wait_firing("PDRequestsStuckBeforeIdleEngines", 60)
        # The router's workers are the proxies now: neither engine's `worker` is listed.
        unrouted = prometheus.wait_firing("PDInstanceNotRouted", 30, pd_instance="decode")
        print("alerts:", json.dumps([stuck, unrouted], indent=1))
        assert unrouted["labels"]["worker"] == cpu_stack.url["decode"]
        assert stuck["labels"]["severity"] == "critical"
        assert stuck["annotations"]["summary"].endswith(
            f"bench/triage --env-dir {cpu_stack.env_dir.resolve()}"
        )
        # Neither engine ever had the request: each holds nothing, by its own snapshot.
        assert not loads.held(cpu_stack.loads("prefill"))
        assert not loads.held(cpu_stack.loads("decode"))
        client.close()
        prometheus.wait_resolved("PDRequestsStuckBeforeIdleEngines", 30)
    finally:
        client.close()
        router_env.write_text(before)
        back = pd(cpu_stack.env_dir, "restart", "router", timeout=120)
        for proxy in proxies:
            proxy.terminate()
        stalls = [proxy.communicate(timeout=30)[1] for proxy in proxies]
    assert back.returncode == 0, back.stdout + back.stderr
    prometheus.wait_resolved("PDInstanceNotRouted", 30)
    for log in stalls:
        assert "stall: request 1 on connection from" in log and "(/generate)" in log, log
    serves_a_fresh_request(cpu_stack)


def test_prefill_restarted_while_a_room_is_quarantined_frees_the_room(cpu_stack):
    """A room quarantined while prefill's scheduler is stopped, then `launch/pd restart prefill`
    at once: decode frees the room's pages by the new prefill's instance id or by the refused
    beats while its port was closed (engine_harness.prefill_restarted_while_quarantined), where
    a restart quicker than two heartbeats left them held for good."""
    line, took = prefill_restarted_while_quarantined(cpu_stack)
    print(f"{took:.1f} s after the restart: {line}")


def test_decode_killed_while_prefill_is_stopped_mid_transfer_prefill_proves_and_serves_on(
    cpu_stack,
):
    """bench/chaos seed 3 fault 2 replayed at a fixed point: prefill stopped mid-transfer,
    decode killed, prefill resumed. Prefill proves the room drained at once (its writes'
    endpoint failed) instead of exiting after the proof's 30 s, and serves again once decode
    is restarted (engine_harness.decode_killed_while_prefill_stopped_mid_transfer)."""
    line = decode_killed_while_prefill_stopped_mid_transfer(cpu_stack, LONG_ROOM)
    print(line)


def test_decode_killed_mid_stream_the_client_sees_an_error_and_co_restart_recovers(
    cpu_stack, prometheus
):
    """Decode killed mid-stream: the client sees an error, and co-restart recovers the stack.
    Co-restart marks each instance before it stops it (PD_TEXTFILE_DIR), so prefill, down for
    longer than --down-after while it restarts, fires no PDInstanceDown."""
    body = {"text": "hello world", "sampling_params": {"max_new_tokens": 2000, "temperature": 0}}
    # A SIGKILLed engine cannot remove its load snapshot file: co-restart's stop of decode
    # removes it, by the name launch/pd kept when decode came up (launch/pdlib/loadfiles.py).
    killed_file = cpu_stack.snapshot_file("decode")
    kill_decode_mid_stream(cpu_stack, body, kill_after=10)
    assert os.path.exists(killed_file)
    started = time.time()
    done = pd(cpu_stack.env_dir, "co-restart")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    time.sleep(2)  # one more scrape and evaluation
    seconds = int(time.time() - started) + 1
    window = f"[{seconds}s]"
    prefill = 'pd_instance="prefill",stack="sm120pd-cpu"'
    down_for = prometheus.query(f"count_over_time((up{{{prefill}}} == 0)[{seconds}s:1s])")
    marked = prometheus.query(f"max_over_time({maintenance.METRIC}{{{prefill}}}{window})")
    firing = 'alertname="PDInstanceDown",alertstate="firing"'
    paged = prometheus.query(f"ALERTS{{{firing},{prefill}}}{window}")
    print("prefill down for", down_for, "scrapes; marked until", marked, "; paged:", paged)
    assert down_for and float(down_for[0]["value"][1]) > 3, down_for
    assert marked and float(marked[0]["value"][1]) > started, marked
    assert not paged, paged
    assert maintenance.read(load_stack(cpu_stack.env_dir, sim=False))["prefill"] == 0
    assert f"removed its load snapshot file {killed_file}" in done.stdout, done.stdout
    assert not os.path.exists(killed_file)
    probe = pd(cpu_stack.env_dir, "probe", timeout=180)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    THROUGH_PD["after co-restart"] = cpu_stack.post("/generate", GREEDY)["output_ids"]


# bench/chaos's CI run: the kinds that leave the engines' processes in place (no restart of an
# engine, about a minute each here), held 2 to 6 s. Seed 6 draws one of each: engine-stop
# decode, router-restart, scheduler-stop prefill (its --dry-run prints the schedule). Long
# prompts of 100 words (527 tokens, 5 prefill chunks here): one of 400 (2166 tokens) took
# longer than this stack's 10 s waiting timeout on 2 cores shared with another stack.
CHAOS_KINDS = ("engine-stop", "router-restart", "scheduler-stop")
CHAOS_ARGS = [
    *("--seed", "6", "--faults", "3", "--duration", "20", "--hold-s", "2,6"),
    *("--kinds", ",".join(CHAOS_KINDS), "--settle-s", "40", "--recover-s", "60"),
    *("--long-words", "100"),
]


def test_chaos_three_seeded_faults_under_load_break_no_invariant(cpu_stack, tmp_path):
    """bench/chaos with a fixed seed: three faults under short, long and multiround load, each
    followed by its checks (no wrong answer, no hang, both engines holding nothing once the
    load pauses, triage naming the faulted engine where requests failed). It exits 0, its
    history and report hold the three faults with requests in each window, and the stack
    serves the greedy tokens it served before."""
    ready(cpu_stack)
    greedy = cpu_stack.post("/generate", GREEDY)["output_ids"]
    out = tmp_path / "chaos"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos"), "--env-dir", str(cpu_stack.env_dir)]
        + [*CHAOS_ARGS, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
    )
    print(done.stdout[-5000:])
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-3000:]
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    faults = [r for r in history if r["type"] == "fault"]
    assert [(f["index"], f["kind"]) for f in faults] == [
        (1, "engine-stop"),
        (2, "router-restart"),
        (3, "scheduler-stop"),
    ]
    for f in faults:
        window = [r for r in history if r["type"] == "request" and r["window"] == str(f["index"])]
        assert any(r["ok"] for r in window), f
    kinds = {r["kind"] for r in history if r["type"] == "request"}
    assert kinds == {"short", "long", "session"}, kinds
    settles = [r for r in history if r["type"] == "settle"]
    assert [s["window"] for s in settles] == ["1", "2", "3", "final"]
    assert all(s["settled"] for s in settles), settles
    report = (out / "report.md").read_text()
    assert "**Result: every invariant held.**" in report, report
    for kind in CHAOS_KINDS:
        assert re.search(rf"^\| {kind} \| 1 \| \d+ \| \d+ \| 0 \| 0 \| ", report, re.M), report
    serves_a_fresh_request(cpu_stack)
    assert cpu_stack.post("/generate", GREEDY)["output_ids"] == greedy


# ---- down, and PD against a standalone engine ------------------------------------------------


def test_down_stops_everything_and_removes_the_key_files_and_snapshot_files(cpu_stack):
    """down removes the three key files, and no sglang load snapshot file is left in /dev/shm
    that was not there before `up` (co-restart's engines included): each engine removed its own
    as it ended (patch 0022), else launch/pd did."""
    files = {role: cpu_stack.snapshot_file(role) for role in ("prefill", "decode")}
    done = pd(cpu_stack.env_dir, "down", timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("its API key file removed") == 3, done.stdout
    assert list((cpu_stack.run_dir / "secrets").iterdir()) == []
    assert cpu_stack.key not in done.stdout + done.stderr
    for role, path in files.items():
        by_engine = f"removed the load snapshot file {path}" in cpu_stack.log(role)
        by_pd = f"removed its load snapshot file {path}" in done.stdout
        print(f"{role}: {path} removed by {'the engine' if by_engine else 'launch/pd'}")
        assert by_engine or by_pd, (role, done.stdout, cpu_stack.log(role)[-2000:])
    assert loads_files_left(LOADS_FILES_BEFORE_UP) == set()


def test_the_k8s_pods_commands_serve_the_stacks_greedy_tokens_and_answer_their_probes(
    cpu_stack, tmp_path
):
    """`launch/pd k8s` rendered from this stack's env files (its API key included), each pod's
    container run as a local process from its own command, args and env by a kubelet stand-in
    (tests/engine/k8s_kubelet.py), the router given the workers its selectors select: every
    startup, readiness and liveness probe answers 200 on its path and port, the stack serves
    GREEDY with the tokens the launch/pd stack gave, an engine's preStop drain returns at
    once on an idle engine, and each engine removes its load snapshot file as it stops. It runs
    after `down` (one stack at a time on the machine); the standalone engine below then
    checks these tokens too."""
    if "first stack" not in THROUGH_PD:
        THROUGH_PD["first stack"] = cpu_stack.post("/generate", GREEDY)["output_ids"]
        down = pd(cpu_stack.env_dir, "down", timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr
    stack = load_stack(cpu_stack.env_dir, sim=False)
    opts = k8s.Options("rbg", "default", "sm120pd:test", f"{stack.unit_prefix}-api-key")
    rendered = k8s.objects(cpu_stack.env_dir, opts)
    assert [p for item in rendered for p in k8s_schema.problems(item.obj)] == []
    pods = k8s_kubelet.pods_of(rendered, tmp_path, k8s_kubelet.secret_data(opts, cpu_stack.key))
    assert [p.name for p in pods] == ["prefill", "decode", "router"]
    try:
        for pod in pods:  # the RBG's dependencies: prefill, decode, then the router
            pod.start(pods)
            pod.wait_probe("startupProbe", 300)
        router = pods[-1]
        router.wait_probe("readinessProbe", 120)
        for pod in pods:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                url, status = pod.probe(kind)
                print(f"{pod.name} {kind} {url}: {status}")
                assert status == 200, (pod.name, kind, url, status)
        THROUGH_PD["k8s pods"] = cpu_stack.post("/generate", GREEDY)["output_ids"]
        assert THROUGH_PD["k8s pods"] == THROUGH_PD["first stack"]
        for pod in pods[:2]:
            hook = pod.pre_stop()
            assert hook.returncode == 0 and "drained after" in hook.stdout, hook
    finally:
        for pod in reversed(pods):
            pod.stop()
    assert loads_files_left(LOADS_FILES_BEFORE_UP) == set()
    for pod in pods:
        assert cpu_stack.key not in pod.log.read_text(errors="replace"), pod.name


def test_greedy_output_through_pd_equals_a_standalone_engine(cpu_stack, tmp_path):
    """Same model, same CPU kernels, no disaggregation: the same greedy tokens show that the KV
    decode used is the KV prefill computed, moved intact. It runs after `down`: the PD
    engines' schedulers poll their queues even when idle, a core each, and beside them this
    engine took 3.5 minutes to start instead of 40 s. Run alone, it takes the PD tokens itself
    and stops the stack first."""
    if "first stack" not in THROUGH_PD:
        THROUGH_PD["first stack"] = cpu_stack.post("/generate", GREEDY)["output_ids"]
        down = pd(cpu_stack.env_dir, "down", timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr
    (port,) = free_loopback_ports(1)
    # The environment the PD engines get from common.env (SGLANG_USE_CPU_ENGINE among it).
    env = dict(os.environ, **envfiles.EnvDir(cpu_stack.env_dir).common())
    log = (tmp_path / "standalone.log").open("wb")
    server = subprocess.Popen(
        [
            str(ROOT / ".venv" / "bin" / "python"),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(ROOT / "build" / "tiny-llama"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--skip-server-warmup",
            *CPU_FLAGS,
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    snapshot_files = set()
    try:

        def healthy() -> bool:
            assert server.poll() is None, (tmp_path / "standalone.log").read_text()[-3000:]
            try:
                return urllib.request.urlopen(url + "/health", timeout=5).status == 200
            except OSError:
                return False

        wait_for(healthy, 300, "the standalone engine answering /health")
        request = urllib.request.Request(
            url + "/generate", json.dumps(GREEDY).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            standalone = json.loads(resp.read())["output_ids"]
        snapshot_files = loads_files_of(server.pid)
        # Stopped as launch/pd stops an engine: SIGTERM to its process group.
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        log.close()
    # Patch 0022: the engine removed its load snapshot file as it ended.
    assert len(snapshot_files) == 1 and not any(map(os.path.exists, snapshot_files))
    assert len(standalone) == 12
    assert THROUGH_PD == dict.fromkeys(THROUGH_PD, standalone), (standalone, THROUGH_PD)
