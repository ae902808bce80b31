"""launch/pd k8s: the stack as Kubernetes objects, rendered from the same env files as every
other verb: a RoleBasedGroup (RBG, sgl-project/rbg) with its CoordinatedPolicy, or an LWS
DisaggregatedSet with a Deployment for the router; the env files as a ConfigMap; the router's
Kubernetes discovery (smg) and its RBAC; a Service in front of the router; a PodMonitor per role
and a PrometheusRule with the rules `launch/pd monitoring` renders.

What an engine pod runs is what launch/prefill.sh and launch/decode.sh run (their --dry-run,
read back), with what a pod changes about a host: each pod binds its own address (POD_IP, from
the downward API) where the env files name a host, SGLANG_HOST_IP is that address too, the GPUs
are the ones the device plugin gives the container (CUDA_VISIBLE_DEVICES is not passed), and
the API key comes from a Secret's files, never from the manifests. Every instance of a role
runs one pod template, so instance files (xPyD) give the replicas and may differ only in where
an instance runs (its host, ports, SGLANG_HOST_IP, GPUs); anything else that differs between
them is refused.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from launch.pdlib import engine_args, k8s_schema, k8s_yaml, monitoring, router_args
from launch.pdlib.envfiles import SECRET_RE, EnvDir, EnvFileError, is_knob
from launch.pdlib.files import write_whole
from launch.pdlib.rotation import DRAIN_TIMEOUT_S
from launch.pdlib.stack import ROOT, Stack, load_stack
from launch.pdlib.systemd_units import NEEDS

FLAVORS = ("rbg", "lws")
ENGINES = ("prefill", "decode")
ROLE_KINDS = ("prefill", "decode", "router")
# Where the ConfigMap (the env files, launch/smg_keyfile.py, launch/k8s_drain.py) and the
# Secret's files appear in every pod.
CONFIG_MOUNT = "/etc/sm120pd"
SECRET_MOUNT = "/var/run/secrets/sm120pd"
# The Secret's keys: the key itself (smg, through launch/smg_keyfile.py, and the drain hook), and
# the same key as sglang's --config YAML (`api-key: KEY`), which is how sglang reads it from a file.
KEY_FILE = "api-key"
ENGINE_CONFIG = "engine.yaml"
NAME_LABEL = "app.kubernetes.io/name"
STACK_LABEL = "app.kubernetes.io/instance"
ROLE_LABEL = "app.kubernetes.io/component"
# smg's Kubernetes discovery (smg 1.13): a prefill pod's bootstrap port, each pod's worker port.
BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"
WORKER_PORTS_ANNOTATION = "smg.ai/worker-ports"
# What a pod replaces of a host: instances may differ in these, and the pods take none of them
# from an instance file.
PLACEMENT = ("_HOST", "_PORT", "SGLANG_HOST_IP", "CUDA_VISIBLE_DEVICES")
# Settings the launch scripts and launch/pd read to build a command line or supervise: not part
# of a process's environment that matters, and some are paths on the host.
LAUNCH_KEYS = {
    "MODEL_PATH",
    "SERVED_MODEL_NAME",
    "TP_SIZE",
    "TRANSFER_BACKEND",
    "API_KEY",
    "SMG_BIN",
    "ROUTER_SHUTDOWN_GRACE_S",
}
# smg's own default --shutdown-grace-period-secs, used when ROUTER_SHUTDOWN_GRACE_S is empty.
SMG_SHUTDOWN_GRACE_S = 180
# What the engine does after the drain: sglang's own stop, which launch/pd gives 20 s.
ENGINE_STOP_S = 30
# sglang's /health with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION on (its default) waits up to
# 20 s for the one-token generation; answered from the server's state, it takes milliseconds.
HEALTH_GENERATION_S = 20
PROBE_PERIOD_S = 10
# A new pod must stay ready this long before the rollout takes the next one down: smg's
# discovery adds it and its health checks pass in a few seconds.
MIN_READY_S = 15
LIVENESS_FAILURES = 3


@dataclass(frozen=True)
class Options:
    flavor: str
    namespace: str
    image: str
    api_key_secret: str


@dataclass(frozen=True)
class Rendered:
    """One object, its file name, and the comments that go above its fields."""

    file: str
    obj: dict
    comments: dict


def launch_key(key: str) -> bool:
    return (
        key in LAUNCH_KEYS
        or key.startswith("PD_")
        or key.endswith(("_HOST", "_PORT", "_ARGS", "_HEALTH_TIMEOUT_S"))
    )


def placement(key: str) -> bool:
    return key.endswith(PLACEMENT[:2]) or key in PLACEMENT[2:]


def problems(env: EnvDir) -> list[str]:
    """What a pod template per role cannot hold: instance files that differ in more than where
    they run, and a secret other than API_KEY (its value would be in the manifests)."""
    found = []
    for kind in ENGINES:
        base = env.role_env(kind)
        for index in env.instances(kind):
            own = env.values(f"{kind}.{index}.env")
            for key, value in own.items():
                if placement(key) or base.get(key) == value:
                    continue
                found.append(
                    f"{env.origin(kind, index, key)}={value}: {kind}/{index} differs from "
                    f"{kind}.env ({base.get(key, 'unset')}), and every {kind} pod runs one pod "
                    "template; instances may differ only in their host, ports, SGLANG_HOST_IP "
                    f"and GPUs. Put the value in {kind}.env for every {kind}, or render a stack "
                    "per value"
                )
    for lines in env.lines.values():
        for line in lines:
            if SECRET_RE.search(line.key) and line.key != "API_KEY" and line.value:
                found.append(
                    f"{line.path}:{line.number}: {line.key}: a secret other than API_KEY would "
                    "be written into the manifests; launch/pd k8s passes only API_KEY, from a "
                    "Secret"
                )
    for kind in ENGINES:
        stall = env.role_env(kind).get("SGLANG_HEALTH_SCHEDULER_STALL_S", "")
        if stall and float(stall) == 0:
            found.append(
                f"{env.origin(kind, None, 'SGLANG_HEALTH_SCHEDULER_STALL_S')}=0: the engines' "
                "liveness probe is /health, which fails on a stopped scheduler only while this "
                "check is on (patch 0033); with it off a wedged scheduler would never be "
                "restarted"
            )
    return found


def _labels(stack: Stack, kind: str) -> dict[str, str]:
    return {NAME_LABEL: "sm120pd", STACK_LABEL: stack.unit_prefix, ROLE_LABEL: kind}


def selector_words(stack: Stack, kind: str) -> list[str]:
    """smg's selector for a role's pods (`key=value` words)."""
    return [f"{k}={v}" for k, v in _labels(stack, kind).items()]


def _env(values: dict[str, str]) -> list[dict]:
    """The container's environment: the pod's address first (the arguments refer to it as
    $(POD_IP)), then what the env files export, less the launch settings and the GPUs."""
    pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    out = [{"name": "POD_IP", "valueFrom": pod_ip}]
    for key, value in values.items():
        if launch_key(key) or key == "CUDA_VISIBLE_DEVICES":
            continue
        if key == "SGLANG_HOST_IP":
            out.append({"name": key, "valueFrom": pod_ip})
        else:
            out.append({"name": key, "value": value})
    return out


def _rewrite_hosts(argv: list[str], config: str | None) -> list[str]:
    """--host (and the router's --prometheus-host) as the pod's address; an engine's --config
    (its API key file under PD_RUN_DIR) as the Secret's file."""
    out = []
    for i, word in enumerate(argv):
        previous = argv[i - 1] if i else ""
        if previous in ("--host", "--prometheus-host"):
            out.append("$(POD_IP)")
        elif previous == "--config" and config:
            out.append(config)
        else:
            out.append(word)
    return out


def _probe(path: str, port: str, period: int, failures: int, timeout: int) -> dict:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def gpus(argv: list[str]) -> int:
    """GPUs one engine uses: TP x PP as sglang's parser reads its command line."""
    table = engine_args.option_table()
    if table is None:
        raise EnvFileError("sglang is not installed for this Python: its parser reads TP and PP")
    parsed, _ = engine_args.parser_from_table(table).parse_known_args(argv)
    return int(getattr(parsed, "tp_size", None) or 1) * int(getattr(parsed, "pp_size", None) or 1)


def _volumes(stack: Stack, with_secret: bool, secret: str, shm: bool) -> list[dict]:
    files = list(stack.env.lines)
    items = [{"key": name, "path": f"env/{name}"} for name in files]
    items += [
        {"key": name, "path": f"launch/{name}"} for name in ("smg_keyfile.py", "k8s_drain.py")
    ]
    volumes = [
        {"name": "config", "configMap": {"name": f"{stack.unit_prefix}-env", "items": items}}
    ]
    if with_secret:
        volumes.append({"name": "api-key", "secret": {"secretName": secret, "defaultMode": 0o400}})
    if shm:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    return volumes


def _mounts(with_secret: bool, shm: bool) -> list[dict]:
    mounts = [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    if with_secret:
        mounts.append({"name": "api-key", "mountPath": SECRET_MOUNT, "readOnly": True})
    if shm:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return mounts


def engine_pod(stack: Stack, kind: str, opts: Options) -> tuple[dict, dict]:
    """(the pod template of a role's engines, comments on its fields)."""
    env, env_dir = stack.env, stack.env.path
    values = env.role_env(kind)
    key = bool(stack.api_key)
    argv = engine_args.engine_argv(env_dir, kind)
    argv = _rewrite_hosts(argv, f"{SECRET_MOUNT}/{ENGINE_CONFIG}" if key else None)
    port = int(values[f"{kind.upper()}_PORT"])
    ports = [{"name": "http", "containerPort": port}]
    annotations = {WORKER_PORTS_ANNOTATION: str(port)}
    if kind == "prefill":
        bootstrap = int(values["PREFILL_BOOTSTRAP_PORT"])
        ports.append({"name": "bootstrap", "containerPort": bootstrap})
        annotations[BOOTSTRAP_ANNOTATION] = str(bootstrap)
    generation = values.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1") not in ("0", "false")
    timeout = HEALTH_GENERATION_S + 5 if generation else 5
    started = max(r.health_timeout_s for r in stack.of_kind(kind))
    drain = [
        "python3",
        f"{CONFIG_MOUNT}/launch/k8s_drain.py",
        "--port",
        str(port),
        "--timeout",
        f"{DRAIN_TIMEOUT_S:g}",
    ] + (["--api-key-file", f"{SECRET_MOUNT}/{KEY_FILE}"] if key else [])
    cpu_engine = values.get("SGLANG_USE_CPU_ENGINE") == "1"
    container = {
        "name": kind,
        "image": opts.image,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": argv,
        "env": _env(values),
        "ports": ports,
        "startupProbe": _probe(
            "/health", "http", PROBE_PERIOD_S, math.ceil(started / PROBE_PERIOD_S), timeout
        ),
        "readinessProbe": _probe("/health", "http", 5, 2, timeout),
        "livenessProbe": _probe("/health", "http", PROBE_PERIOD_S, LIVENESS_FAILURES, timeout),
        "lifecycle": {"preStop": {"exec": {"command": drain}}},
        "volumeMounts": _mounts(key, True),
    }
    if not cpu_engine:
        count = str(gpus(argv))
        container["resources"] = {
            "requests": {"nvidia.com/gpu": count},
            "limits": {"nvidia.com/gpu": count},
        }
    pod = {
        "metadata": {"labels": _labels(stack, kind), "annotations": annotations},
        "spec": {
            "terminationGracePeriodSeconds": int(DRAIN_TIMEOUT_S) + ENGINE_STOP_S,
            "restartPolicy": "Always",
            "containers": [container],
            "volumes": _volumes(stack, key, opts.api_key_secret, True),
        },
    }
    stall = values.get("SGLANG_HEALTH_SCHEDULER_STALL_S") or "30"
    c = ("spec", "containers", kind)
    comments = {
        ("metadata", "annotations"): f"smg's Kubernetes discovery reads the worker's port from "
        f"{WORKER_PORTS_ANNOTATION}"
        + (
            f" and prefill's bootstrap port from {BOOTSTRAP_ANNOTATION}."
            if kind == "prefill"
            else "."
        ),
        ("spec", "terminationGracePeriodSeconds"): f"The preStop hook waits up to "
        f"{DRAIN_TIMEOUT_S:g} s (launch/pd rolling-restart's drain timeout) for the engine to hold "
        f"no request; smg has already dropped the terminating pod, so none arrives. Then "
        f"{ENGINE_STOP_S} s for sglang's own stop after SIGTERM.",
        ("spec", "restartPolicy"): "The kubelet restarts the engine's container in place after "
        "a crash or a failed liveness probe: an engine (all its TP ranks) is one container, so "
        "there is no group of pods to recreate.",
        (*c, "args"): f"launch/{kind}.sh's command line (its --dry-run), with --host as the pod's "
        "address" + (" and --config as the Secret's file." if key else "."),
        (*c, "env"): "The env files' settings as launch/" + kind + ".sh exports them, less "
        "launch/pd's own and CUDA_VISIBLE_DEVICES (the device plugin picks the GPUs); "
        "SGLANG_HOST_IP is the pod's address.",
        (*c, "startupProbe"): f"Loading may take the env files' {kind.upper()}_HEALTH_TIMEOUT_S "
        f"({started:g} s); /health answers 503 until the engine is up.",
        (*c, "readinessProbe"): "/health: 503 while starting, stopping, or while a scheduler has "
        "not published its load snapshot for SGLANG_HEALTH_SCHEDULER_STALL_S (patch 0033).",
        (*c, "livenessProbe"): f"/health fails on a dead HTTP server and, with patch 0033, on a "
        f"scheduler that has stood still for SGLANG_HEALTH_SCHEDULER_STALL_S ({stall} s): a "
        f"wedged scheduler behind a live HTTP server is restarted after {LIVENESS_FAILURES} "
        "failed probes."
        + (
            f" With SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION on, /health also runs a one-token "
            f"generation (up to {HEALTH_GENERATION_S} s), hence the timeout."
            if generation
            else ""
        ),
        (*c, "lifecycle"): "Drain before SIGTERM: launch/k8s_drain.py polls /v1/loads until "
        "nothing runs or waits, as launch/pd rolling-restart does.",
    }
    if not cpu_engine:
        comments[(*c, "resources")] = (
            "GPUs: the engine's TP x PP size (sglang's parser on its args)."
        )
    return pod, comments


def router_container(stack: Stack, opts: Options) -> tuple[dict, dict]:
    """(the router's pod template, comments): launch/router.sh's command line with smg's
    Kubernetes discovery in place of the worker URLs or the worker file."""
    values = stack.env.role_env("router")
    key = bool(stack.api_key)
    words = router_args.launch_args(router_args.router_command(stack.env.path))
    skip = {"--prefill": 2, "--decode": 1, "--discovery-provider": 1, "--discovery-file": 1}
    skip["--discovery-check-interval-secs"] = 1
    kept: list[str] = []
    i = 0
    while i < len(words):
        if words[i] in skip:
            i += 1 + skip[words[i]]
            continue
        kept.append(words[i])
        i += 1
    discovery = [
        "--discovery-provider",
        "kubernetes",
        "--service-discovery-namespace",
        opts.namespace,
        "--service-discovery-port",
        values["DECODE_PORT"],
        "--prefill-selector",
        *selector_words(stack, "prefill"),
        "--decode-selector",
        *selector_words(stack, "decode"),
    ]
    at = kept.index("--pd-disaggregation") + 1
    args = ["launch", *_rewrite_hosts(kept[:at] + discovery + kept[at:], None)]
    if key:
        command = [
            "python3",
            f"{CONFIG_MOUNT}/launch/smg_keyfile.py",
            "--api-key-file",
            f"{SECRET_MOUNT}/{KEY_FILE}",
        ]
    else:
        command = ["smg"]
    grace = values.get("ROUTER_SHUTDOWN_GRACE_S") or str(SMG_SHUTDOWN_GRACE_S)
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--shutdown-grace-period-secs":
            grace = value
    started = stack.role("router").health_timeout_s
    container = {
        "name": "router",
        "image": opts.image,
        "command": command,
        "args": args,
        # smg reads none of the engines' knobs.
        "env": _env({k: v for k, v in values.items() if not is_knob(k)}),
        "ports": [
            {"name": "http", "containerPort": int(values["ROUTER_PORT"])},
            {"name": "metrics", "containerPort": int(values["ROUTER_PROMETHEUS_PORT"])},
        ],
        "startupProbe": _probe("/liveness", "http", 5, math.ceil(started / 5), 5),
        "readinessProbe": _probe("/readiness", "http", 5, 2, 5),
        "livenessProbe": _probe("/liveness", "http", PROBE_PERIOD_S, LIVENESS_FAILURES, 5),
        "volumeMounts": _mounts(key, False),
    }
    pod = {
        "metadata": {"labels": _labels(stack, "router")},
        "spec": {
            "serviceAccountName": f"{stack.unit_prefix}-router",
            "terminationGracePeriodSeconds": int(grace) + 10,
            "restartPolicy": "Always",
            "containers": [container],
            "volumes": _volumes(stack, key, opts.api_key_secret, False),
        },
    }
    c = ("spec", "containers", "router")
    comments = {
        (*c, "args"): "launch/router.sh's command line (its --dry-run), with smg's Kubernetes "
        "discovery in place of --prefill/--decode (or the worker file): its selectors are the "
        "engine pods' labels, each worker's port and prefill's bootstrap port come from the "
        "pods' annotations. --host and --prometheus-host are the pod's address.",
        (*c, "readinessProbe"): "/readiness: smg has a healthy prefill and decode (what launch/pd "
        "waits on); the Service sends clients only to a ready router.",
        (*c, "livenessProbe"): "/liveness: smg's process answers; a router without workers is "
        "not restarted for it (readiness covers that).",
        ("spec", "terminationGracePeriodSeconds"): f"smg drains in-flight requests for "
        f"--shutdown-grace-period-secs ({grace} s) after SIGTERM; 10 s more before SIGKILL.",
        ("spec", "serviceAccountName"): "smg lists and watches pods in this namespace (Role "
        f"{stack.unit_prefix}-router).",
    }
    return pod, comments


def _meta(stack: Stack, opts: Options, name: str, kind: str | None = None) -> dict:
    labels = {NAME_LABEL: "sm120pd", STACK_LABEL: stack.unit_prefix}
    if kind:
        labels[ROLE_LABEL] = kind
    return {"name": name, "namespace": opts.namespace, "labels": labels}


def config_map(stack: Stack, opts: Options) -> dict:
    """The env files as they are (API_KEY's value left out: it is in the Secret), with the two
    scripts the pods run from it."""
    data = {}
    for name in stack.env.lines:
        text = (stack.env.path / name).read_text()
        for line in stack.env.lines[name]:
            if line.key == "API_KEY" and line.value:
                note = f"# launch/pd k8s: the key is in Secret {opts.api_key_secret}, not here."
                text = text.replace(line.raw, f"{note}\nAPI_KEY=")
        data[name] = text
    for script in ("smg_keyfile.py", "k8s_drain.py"):
        data[script] = (ROOT / "launch" / script).read_text()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(stack, opts, f"{stack.unit_prefix}-env"),
        "data": data,
    }


def rbac(stack: Stack, opts: Options) -> list[dict]:
    name = f"{stack.unit_prefix}-router"
    meta = _meta(stack, opts, name, "router")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": opts.namespace}],
        },
    ]


def router_service(stack: Stack, opts: Options) -> dict:
    port = int(stack.env.role_env("router")["ROUTER_PORT"])
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(stack, opts, f"{stack.unit_prefix}-router", "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": _labels(stack, "router"),
            "ports": [{"name": "http", "port": port, "targetPort": "http"}],
        },
    }


def replicas(stack: Stack, kind: str) -> int:
    return len(stack.of_kind(kind))


ENGINE_ROLLOUT = (
    "One engine down at a time and no surge: a surge pod needs spare GPUs, and a rollout waiting "
    "on a pod that cannot be scheduled stops. RecreatePod: a knob is an environment variable, "
    "which an in-place update cannot change in a running container."
)
ROUTER_ROLLOUT = (
    "The router is CPU only and cheap to add: a new one comes up beside the old one (surge 1, "
    "none unavailable), so clients always have a ready router."
)
RESTART = (
    "No role-level restart: each engine is one pod (all its TP ranks in one container), which "
    "the kubelet restarts in place (restartPolicy Always); prefill and decode survive each "
    "other's restarts (decode's heartbeat, the PD timeouts), so one never recreates the other."
)


def rbg(stack: Stack, opts: Options) -> list[Rendered]:
    name = stack.unit_prefix
    roles, comments = [], {}
    for kind in ROLE_KINDS:
        if kind == "router":
            template, pod_comments = router_container(stack, opts)
            rollout = {"maxUnavailable": 0, "maxSurge": 1}
        else:
            template, pod_comments = engine_pod(stack, kind, opts)
            rollout = {"type": "RecreatePod", "maxUnavailable": 1, "maxSurge": 0}
        path = ("spec", "roles", kind)
        role = {
            "name": kind,
            "replicas": replicas(stack, kind),
            "minReadySeconds": MIN_READY_S,
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdate": rollout},
            "standalonePattern": {"template": template},
        }
        needs = [k for k in NEEDS[kind] if k in ROLE_KINDS]
        if needs:
            role["dependencies"] = needs
            comments[(*path, "dependencies")] = (
                f"Started after {' and '.join(needs)} are ready, the order of launch/pd up."
            )
        roles.append(role)
        comments[(*path, "replicas")] = (
            f"{kind}'s instances in the env files ({kind}.N.env; one without them)."
            if kind != "router"
            else "One router, as launch/pd runs it."
        )
        comments[(*path, "rolloutStrategy")] = (
            ROUTER_ROLLOUT if kind == "router" else ENGINE_ROLLOUT
        )
        comments[(*path, "minReadySeconds")] = (
            f"A new pod stays ready {MIN_READY_S} s (smg discovers it and its health checks pass) "
            "before the rollout takes the next one."
        )
        if kind != "router":
            comments[(*path, "standalonePattern")] = RESTART
        template_path = (*path, "standalonePattern", "template")
        comments.update({(*template_path, *k): v for k, v in pod_comments.items()})
    group = {
        "apiVersion": "workloads.x-k8s.io/v1alpha2",
        "kind": "RoleBasedGroup",
        "metadata": _meta(stack, opts, name),
        "spec": {"roles": roles},
    }
    policy = {
        "apiVersion": "workloads.x-k8s.io/v1alpha2",
        "kind": "CoordinatedPolicy",
        "metadata": _meta(stack, opts, name),
        "spec": {
            "policies": [
                {
                    "name": "prefill-decode",
                    "roles": list(ENGINES),
                    "strategy": {
                        "rollingUpdate": {"maxSkew": 1, "maxUnavailable": 1},
                        "scaling": {"maxSkew": 1, "progression": "OrderReady"},
                    },
                }
            ]
        },
    }
    policy_comments = {
        ("metadata", "name"): "The RBG controller reads the CoordinatedPolicy of its group's "
        "name and namespace.",
        ("spec", "policies", "prefill-decode", "strategy", "rollingUpdate"): "Prefill and "
        "decode roll in step: their updated pods never differ by more than one (maxSkew 1), so "
        "the P:D ratio and versions stay together, and at most one engine of either role is "
        "down at once (as launch/pd rolling-restart takes one instance at a time).",
        ("spec", "policies", "prefill-decode", "strategy", "scaling"): "A scale-out adds "
        "prefills and decodes together, each step once the last one's pods are ready.",
    }
    return [
        Rendered("40-rolebasedgroup.yaml", group, comments),
        Rendered("41-coordinatedpolicy.yaml", policy, policy_comments),
    ]


def lws(stack: Stack, opts: Options) -> list[Rendered]:
    name = stack.unit_prefix
    roles, comments = [], {}
    for kind in ENGINES:
        template, pod_comments = engine_pod(stack, kind, opts)
        path = ("spec", "roles", kind, "spec")
        roles.append(
            {
                "name": kind,
                "spec": {
                    "replicas": replicas(stack, kind),
                    "leaderWorkerTemplate": {
                        "size": 1,
                        "restartPolicy": "None",
                        "workerTemplate": template,
                    },
                    "rolloutStrategy": {
                        "type": "RollingUpdate",
                        "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
                    },
                },
            }
        )
        comments[(*path, "replicas")] = f"{kind}'s instances in the env files."
        comments[(*path, "leaderWorkerTemplate", "restartPolicy")] = RESTART
        comments[(*path, "rolloutStrategy")] = (
            "DisaggregatedSet rolls prefill and decode together (a new revision's groups come up "
            "step by step in both roles, in proportion); per role, " + ENGINE_ROLLOUT
        )
        template_path = (*path, "leaderWorkerTemplate", "workerTemplate")
        comments.update({(*template_path, *k): v for k, v in pod_comments.items()})
    dset = {
        "apiVersion": "disaggregatedset.x-k8s.io/v1",
        "kind": "DisaggregatedSet",
        "metadata": _meta(stack, opts, name),
        "spec": {"roles": roles},
    }
    template, pod_comments = router_container(stack, opts)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(stack, opts, f"{name}-router", "router"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": _labels(stack, "router")},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "minReadySeconds": MIN_READY_S,
            "template": template,
        },
    }
    router_comments = {("spec", "strategy"): ROUTER_ROLLOUT}
    router_comments.update({("spec", "template", *k): v for k, v in pod_comments.items()})
    return [
        Rendered("40-disaggregatedset.yaml", dset, comments),
        Rendered("41-router-deployment.yaml", deployment, router_comments),
    ]


def pod_monitors(stack: Stack, opts: Options) -> list[dict]:
    """One per role, so each scrape job has the job name and labels `launch/pd monitoring`'s
    rules select: job PREFIX-ROLE, pd_instance (the pod), pd_role, stack, and for an engine the
    `worker` URL under which smg's discovery lists it."""
    out = []
    for kind in ROLE_KINDS:
        relabel = [
            {"targetLabel": "job", "replacement": monitoring.job(stack, kind)},
            {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "pd_instance"},
            {"targetLabel": "pd_role", "replacement": kind},
            {"targetLabel": "stack", "replacement": stack.unit_prefix},
        ]
        if kind != "router":
            port = stack.env.role_env(kind)[f"{kind.upper()}_PORT"]
            relabel.append(
                {
                    "sourceLabels": ["__meta_kubernetes_pod_ip"],
                    "targetLabel": "worker",
                    "replacement": f"http://$1:{port}",
                }
            )
        out.append(
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "PodMonitor",
                "metadata": _meta(stack, opts, monitoring.job(stack, kind), kind),
                "spec": {
                    "selector": {"matchLabels": _labels(stack, kind)},
                    "podMetricsEndpoints": [
                        {
                            "port": "metrics" if kind == "router" else "http",
                            "path": "/metrics",
                            "interval": "15s",
                            "relabelings": relabel,
                        }
                    ],
                },
            }
        )
    return out


def monitoring_rules(stack: Stack) -> dict:
    """What `launch/pd monitoring` writes to rules.yml with its defaults, for this env dir."""
    windows = monitoring.windows(stack, 120.0, 300.0, 60.0)
    return monitoring.rules(stack, windows, stack.env.path.resolve())


def prometheus_rule(stack: Stack, opts: Options) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _meta(stack, opts, stack.unit_prefix),
        "spec": monitoring_rules(stack),
    }


def objects(env_dir: Path, opts: Options) -> list[Rendered]:
    """Every object, in the order `kubectl apply -f DIR` takes the files."""
    stack = load_stack(env_dir, sim=False)
    refused = problems(stack.env)
    if refused:
        raise K8sRefused(refused)
    out = [Rendered("10-configmap.yaml", config_map(stack, opts), {})]
    for i, obj in enumerate(rbac(stack, opts)):
        out.append(Rendered(f"2{i}-{obj['kind'].lower()}.yaml", obj, {}))
    out += rbg(stack, opts) if opts.flavor == "rbg" else lws(stack, opts)
    out.append(Rendered("50-router-service.yaml", router_service(stack, opts), {}))
    for i, obj in enumerate(pod_monitors(stack, opts)):
        out.append(Rendered(f"6{i}-podmonitor-{ROLE_KINDS[i]}.yaml", obj, {}))
    out.append(Rendered("70-prometheusrule.yaml", prometheus_rule(stack, opts), {}))
    return out


class K8sRefused(EnvFileError):
    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def router_refusals(stack: Stack, rendered: list[Rendered]) -> list[str]:
    """The router container's arguments, read by the parser of the smg that SMG_BIN runs."""
    smg_bin = router_args.find_smg_bin(
        stack.env.role_env("router").get("SMG_BIN") or "smg",
        stack.env.role_env("router").get("PATH"),
    )
    if smg_bin is None:
        return ["router: SMG_BIN not found, so smg's parser could not read the router's flags"]
    python = router_args.smg_python(smg_bin)
    found = []
    for item in rendered:
        for container in containers(item.obj):
            if container["name"] != "router":
                continue
            for flag, message in router_args.ask_smg(python, "refusals", container["args"][1:]):
                found.append(f"router: {flag}: smg's parser refuses it ({message})")
    return found


def containers(obj: dict) -> list[dict]:
    """Every container of every pod template in obj."""
    found = []
    for _, template in k8s_schema._pod_templates(obj.get("spec", {})):
        found += template["spec"]["containers"]
    return found


def render(out: Path, env_dir: Path, opts: Options) -> list[Path]:
    """Write one file per object into out, after every object passed its schema and the
    router's flags smg's parser; nothing is written otherwise."""
    rendered = objects(env_dir, opts)
    stack = load_stack(env_dir, sim=False)
    refused = [line for item in rendered for line in k8s_schema.problems(item.obj)]
    refused += router_refusals(stack, rendered)
    if refused:
        raise K8sRefused(refused)
    head = (
        f"Rendered by launch/pd k8s --flavor {opts.flavor} from {env_dir.resolve()}; render again "
        "after the env files change (launch/README.md, Kubernetes)."
    )
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for item in rendered:
        path = out / item.file
        write_whole(path, k8s_yaml.dump(item.obj, item.comments, head), 0o644)
        written.append(path)
    return written


def secret_command(opts: Options) -> str:
    """How to make the Secret the pods read, from a shell where KEY holds the key."""
    return (
        f"kubectl -n {shlex.quote(opts.namespace)} create secret generic "
        f'{shlex.quote(opts.api_key_secret)} --from-literal={KEY_FILE}="$KEY" '
        f"--from-literal={ENGINE_CONFIG}=\"api-key: '$KEY'\""
    )
