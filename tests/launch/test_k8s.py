"""launch/pd k8s without a cluster: every rendered object against the schema its API server
would apply (the vendored CRDs of RBG, LWS and prometheus-operator; Kubernetes' own for core
kinds), smg's selectors read with smg's own parser against the pods' labels, the PrometheusRule
against what `launch/pd monitoring` renders, the refusals, and the API key kept out of every
file. The pods' commands run for real in tests/engine/test_cpu_engines.py (the kubelet stand-in
is tests/engine/k8s_kubelet.py). No API server runs here: what a controller does with these
objects is not tested."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from launch_harness import ROOT, run_pd

from launch.pdlib import envfiles, k8s, k8s_schema, router_args
from launch.pdlib.stack import load_stack

IMAGE = "registry.example/sm120pd:test"
KEY = "k8s-test-key-7f3a9c"


def render(env_dir: Path, out: Path, *extra: str):
    return run_pd("k8s", "--env-dir", str(env_dir), "--out", str(out), "--image", IMAGE, *extra)


def documents(out: Path) -> dict[str, dict]:
    found = {}
    for path in sorted(out.glob("*.yaml")):
        (doc,) = list(yaml.safe_load_all(path.read_text()))
        found[path.name] = doc
    return found


def copy_env(tmp: Path, src: str = "cpu", **values: str) -> Path:
    env = tmp / "env"
    shutil.copytree(ROOT / "env" / src, env, ignore=shutil.ignore_patterns("ab", "backups"))
    if values:
        envfiles.set_values(env / "common.env", values)
    return env


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
@pytest.mark.parametrize("src", ["", "cpu"])
def test_every_rendered_object_passes_its_schema_and_reads_back_as_rendered(tmp_path, flavor, src):
    """Each file is one object that its schema accepts, and the YAML with its comments reads
    back as the object the renderer built."""
    env = ROOT / "env" / src if src else ROOT / "env"
    done = render(env, tmp_path / "out", "--flavor", flavor)
    assert done.returncode == 0, done.stdout + done.stderr
    docs = documents(tmp_path / "out")
    kinds = sorted(d["kind"] for d in docs.values())
    workload = ["CoordinatedPolicy", "RoleBasedGroup"] if flavor == "rbg" else ["Deployment"]
    workload += ["DisaggregatedSet"] if flavor == "lws" else []
    assert kinds == sorted(
        ["ConfigMap", "PodMonitor", "PodMonitor", "PodMonitor", "PrometheusRule", "Role"]
        + ["RoleBinding", "Service", "ServiceAccount", *workload]
    )
    opts = k8s.Options(flavor, "default", IMAGE, f"{load_stack(env, False).unit_prefix}-api-key")
    rendered = {item.file: item.obj for item in k8s.objects(env, opts)}
    assert docs == rendered
    for name, doc in docs.items():
        assert k8s_schema.problems(doc) == [], name


def test_the_schemas_refuse_what_an_api_server_would(tmp_path):
    """The validator can fail: an unknown field in each custom resource, a bad value in an
    embedded pod template, a core kind's wrong type."""
    opts = k8s.Options("rbg", "default", IMAGE, "s")
    objs = {i.obj["kind"]: i.obj for i in k8s.objects(ROOT / "env", opts)}
    objs |= {
        i.obj["kind"]: i.obj for i in k8s.objects(ROOT / "env", k8s.Options("lws", "d", IMAGE, "s"))
    }
    for kind in ("RoleBasedGroup", "CoordinatedPolicy", "DisaggregatedSet", "PodMonitor"):
        bad = copy.deepcopy(objs[kind])
        bad["spec"]["surprise"] = 1
        assert any("'surprise' was unexpected" in p for p in k8s_schema.problems(bad)), kind
    bad = copy.deepcopy(objs["PrometheusRule"])
    bad["spec"]["groups"][0]["rules"][0]["for"] = "two minutes"
    assert any("groups[0].rules[0].for" in p for p in k8s_schema.problems(bad))
    bad = copy.deepcopy(objs["RoleBasedGroup"])
    role = bad["spec"]["roles"][1]
    role["standalonePattern"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = (
        "http"
    )
    found = k8s_schema.problems(bad)
    assert any("Kubernetes" in p and "containerPort" in p for p in found), found
    bad = copy.deepcopy(objs["ConfigMap"])
    bad["data"]["common.env"] = 1
    assert any("common.env" in p for p in k8s_schema.problems(bad))


# smg's own reading of a `smg launch` command line: its parser (RouterArgs.add_cli_args), then
# RouterArgs.from_cli_args as `smg launch` does, under smg's interpreter. router_args.py's own
# `settings` fingerprints the selectors (their help says "key1=value1"), so this reads them.
READ_AS_SMG = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
import router_args
parser, RouterArgs = router_args._parser()
read = RouterArgs.from_cli_args(parser.parse_args(sys.argv[2:]), use_router_prefix=False)
print(json.dumps(dataclasses.asdict(read), default=str))
"""


def smg_settings(router: dict) -> dict:
    python = router_args.smg_python(router_args.find_smg_bin(".venv/bin/smg"))
    done = subprocess.run(
        [python, "-c", READ_AS_SMG, str(ROOT / "launch" / "pdlib"), *router["args"][1:]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """smg's rule (service_discovery.rs matches_selector): every key=value of the selector is
    a label of the pod; an empty selector matches nothing."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("flavor", k8s.FLAVORS)
def test_smgs_selectors_select_exactly_their_roles_pods(flavor):
    """The router's arguments read by smg's own parser: Kubernetes discovery in PD mode, in the
    stack's namespace, the prefill selector matching the prefill pods' labels and no other
    pod's, the same for decode; the annotations smg reads give each role's ports."""
    opts = k8s.Options(flavor, "inference", IMAGE, "s")
    pods: dict[str, list[dict]] = {}
    for item in k8s.objects(ROOT / "env", opts):
        for _, template in k8s_schema._pod_templates(item.obj.get("spec", {})):
            (container,) = template["spec"]["containers"]
            pods.setdefault(container["name"], []).append(template)
    assert sorted(pods) == ["decode", "prefill", "router"]
    settings = smg_settings(pods["router"][0]["spec"]["containers"][0])
    assert settings["discovery_provider"] == "kubernetes"
    assert settings["pd_disaggregation"] is True
    assert settings["service_discovery_namespace"] == "inference"
    assert settings["prefill_urls"] == [] and settings["decode_urls"] == []
    for role in ("prefill", "decode"):
        selector = settings[f"{role}_selector"]
        chosen = {
            name
            for name, templates in pods.items()
            for t in templates
            if matches(selector, t["metadata"]["labels"])
        }
        assert chosen == {role}, (role, selector)
    values = load_stack(ROOT / "env", False).env
    prefill = pods["prefill"][0]["metadata"]["annotations"]
    assert prefill[k8s.BOOTSTRAP_ANNOTATION] == values.role_env("prefill")["PREFILL_BOOTSTRAP_PORT"]
    for role in ("prefill", "decode"):
        port = values.role_env(role)[f"{role.upper()}_PORT"]
        assert pods[role][0]["metadata"]["annotations"][k8s.WORKER_PORTS_ANNOTATION] == port
    assert k8s.BOOTSTRAP_ANNOTATION not in pods["decode"][0]["metadata"]["annotations"]


def test_the_prometheus_rule_carries_what_launch_pd_monitoring_renders(tmp_path):
    """Same groups, names, expressions and windows as rules.yml from `launch/pd monitoring`;
    the PodMonitors give each scrape the job and labels those rules select."""
    monitoring_out = tmp_path / "monitoring"
    done = run_pd(
        "monitoring", "--env-dir", str(ROOT / "env" / "cpu"), "--out", str(monitoring_out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rules = yaml.safe_load((monitoring_out / "rules.yml").read_text())
    done = render(ROOT / "env" / "cpu", tmp_path / "k8s")
    assert done.returncode == 0, done.stdout + done.stderr
    docs = documents(tmp_path / "k8s")
    assert docs["70-prometheusrule.yaml"]["spec"] == rules
    jobs = {
        c["job_name"]
        for c in yaml.safe_load((monitoring_out / "prometheus.yml").read_text())["scrape_configs"]
    }
    relabeled = set()
    for name, doc in docs.items():
        if doc["kind"] != "PodMonitor":
            continue
        (endpoint,) = doc["spec"]["podMetricsEndpoints"]
        targets = {r["targetLabel"]: r for r in endpoint["relabelings"]}
        relabeled.add(targets["job"]["replacement"])
        assert {"pd_instance", "pd_role", "stack"} <= set(targets), name
        role = targets["pd_role"]["replacement"]
        assert ("worker" in targets) == (role != "router"), name
    assert relabeled == jobs


def test_instance_files_give_the_replicas_and_may_differ_only_in_placement(tmp_path):
    env = copy_env(tmp_path, "")
    for path in (ROOT / "env" / "2p2d").glob("*.env"):
        shutil.copy(path, env)
    done = render(env, tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr
    group = documents(tmp_path / "out")["40-rolebasedgroup.yaml"]
    assert {r["name"]: r["replicas"] for r in group["spec"]["roles"]} == {
        "prefill": 2,
        "decode": 2,
        "router": 1,
    }
    with (env / "decode.2.env").open("a") as f:
        f.write("# a knob for decode/2 alone\nSGLANG_SM120_MMA_TARGET_CTAS=512\n")
    done = render(env, tmp_path / "refused")
    assert done.returncode == 2
    assert "decode.2.env:" in done.stderr and "SGLANG_SM120_MMA_TARGET_CTAS=512" in done.stderr
    assert "one pod template" in done.stderr
    assert not (tmp_path / "refused").exists()


def test_the_api_key_is_a_secret_reference_and_in_no_file(tmp_path):
    env = copy_env(tmp_path, "cpu", API_KEY=KEY)
    done = render(env, tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr
    assert KEY not in done.stdout + done.stderr
    assert "kubectl -n default create secret generic sm120pd-cpu-api-key" in done.stdout
    for path in (tmp_path / "out").iterdir():
        assert KEY not in path.read_text(), path.name
    docs = documents(tmp_path / "out")
    assert "\nAPI_KEY=\n" in docs["10-configmap.yaml"]["data"]["common.env"]
    group = docs["40-rolebasedgroup.yaml"]
    for role in group["spec"]["roles"]:
        spec = role["standalonePattern"]["template"]["spec"]
        (container,) = spec["containers"]
        secrets = [v for v in spec["volumes"] if "secret" in v]
        assert secrets == [
            {
                "name": "api-key",
                "secret": {"secretName": "sm120pd-cpu-api-key", "defaultMode": 0o400},
            }
        ]
        words = container["command"] + container["args"]
        if role["name"] == "router":
            assert words[1:4] == [
                f"{k8s.CONFIG_MOUNT}/launch/smg_keyfile.py",
                "--api-key-file",
                f"{k8s.SECRET_MOUNT}/{k8s.KEY_FILE}",
            ]
        else:
            config = words.index("--config")
            assert words[config + 1] == f"{k8s.SECRET_MOUNT}/{k8s.ENGINE_CONFIG}"
        assert "API_KEY" not in {e["name"] for e in container["env"]}


@pytest.mark.parametrize(
    "file,line,why",
    [
        ("decode.env", "SGLANG_SM120_MMA_TARGET_CTAS=0", "TARGET_CTAS"),
        ("decode.env", "SGLANG_HEALTH_SCHEDULER_STALL_S=0", "wedged scheduler"),
        ("common.env", "HF_TOKEN=hf_secret_value", "a secret other than API_KEY"),
    ],
)
def test_what_env_check_or_a_pod_could_not_hold_is_refused_and_nothing_written(
    tmp_path, file, line, why
):
    env = copy_env(tmp_path)
    with (env / file).open("a") as f:
        f.write(f"# test\n{line}\n")
    done = render(env, tmp_path / "out")
    assert done.returncode == 2, done.stdout + done.stderr
    assert why in done.stderr and "nothing written" in done.stderr
    assert "hf_secret_value" not in done.stdout + done.stderr
    assert not (tmp_path / "out").exists()


def test_the_engines_run_the_launch_scripts_command_lines_and_knobs(tmp_path):
    """Engine args are launch/ROLE.sh --dry-run's, the host as the pod's address; every knob of
    the env files is in the container's environment with its value; TP is the GPU request."""
    opts = k8s.Options("rbg", "default", IMAGE, "s")
    (group,) = [i.obj for i in k8s.objects(ROOT / "env", opts) if i.obj["kind"] == "RoleBasedGroup"]
    env = envfiles.EnvDir(ROOT / "env")
    for role in group["spec"]["roles"][:2]:
        kind = role["name"]
        (container,) = role["standalonePattern"]["template"]["spec"]["containers"]
        from launch.pdlib import engine_args

        expected = engine_args.engine_argv(ROOT / "env", kind)
        host = expected.index("--host") + 1
        expected[host] = "$(POD_IP)"
        assert container["args"] == expected
        given = {e["name"]: e.get("value") for e in container["env"]}
        for key, value in env.knobs(kind).items():
            if key in ("CUDA_VISIBLE_DEVICES", "SGLANG_HOST_IP"):
                continue
            assert given[key] == value, key
        assert "CUDA_VISIBLE_DEVICES" not in given
        tp = env.role_env(kind)["TP_SIZE"]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": tp}
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
