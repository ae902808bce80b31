"""A test-only stand-in for the kubelet: it runs the containers `launch/pd k8s` rendered as local
processes, from their own command, args and env, and reads their probes.

What it does as the kubelet would: the container's env in order, `valueFrom.fieldRef
status.podIP` as the pod's address, `$(VAR)` in command and args expanded from that env (Kubernetes'
rule: a variable defined earlier in the list; anything else stays as written), the ConfigMap's
and the Secret's volumes as files at the paths the pod reads (each mount path a local folder
here), a named probe port looked up in the container's ports, preStop before SIGTERM, SIGKILL
after the grace period. The image's PATH is this checkout's .venv/bin, its working directory
the checkout (env/cpu's MODEL_PATH is relative to it). What it does not do: scheduling, pod
networking (every pod is on 127.0.0.1, with the env files' ports), resources, restarts.

smg's Kubernetes discovery cannot run without an API server, so the router's discovery flags
are replaced with the workers they select: every pod whose labels match the prefill (decode)
selector, by smg's matching rule, at http://POD_IP:PORT with PORT from the pod's
smg.ai/worker-ports annotation and prefill's bootstrap port from sglang.ai/bootstrap-port, as
smg's discovery reads them (smg 1.13 service_discovery.rs). The selectors' match with smg's own
parser is tests/launch/test_k8s.py's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launch.pdlib import k8s  # noqa: E402

POD_IP = "127.0.0.1"
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
DISCOVERY_FLAGS = {
    "--discovery-provider": 1,
    "--service-discovery-namespace": 1,
    "--service-discovery-port": 1,
}
SELECTOR_FLAGS = ("--prefill-selector", "--decode-selector")


def expand(word: str, env: dict[str, str]) -> str:
    return VAR.sub(lambda m: env.get(m.group(1), m.group(0)), word)


def container_env(container: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        else:
            assert item["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, item
            env[item["name"]] = POD_IP
    return env


def selected_workers(args: list[str], pods: list[Pod]) -> list[str]:
    """The router's args with the discovery flags replaced by the workers they select."""
    out, selectors, i = [], {}, 0
    while i < len(args):
        word = args[i]
        if word in DISCOVERY_FLAGS:
            i += 1 + DISCOVERY_FLAGS[word]
        elif word in SELECTOR_FLAGS:
            pairs = []
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                pairs.append(args[i].split("=", 1))
                i += 1
            selectors[word.removeprefix("--").removesuffix("-selector")] = dict(pairs)
        else:
            out.append(word)
            i += 1
    workers = []
    for role, selector in selectors.items():
        for pod in pods:
            labels = pod.template["metadata"]["labels"]
            if not all(labels.get(k) == v for k, v in selector.items()):
                continue
            notes = pod.template["metadata"]["annotations"]
            url = f"http://{POD_IP}:{notes[k8s.WORKER_PORTS_ANNOTATION]}"
            workers += [f"--{role}", url]
            if role == "prefill":
                workers.append(notes[k8s.BOOTSTRAP_ANNOTATION])
    at = out.index("--pd-disaggregation") + 1
    return out[:at] + workers + out[at:]


class Pod:
    """One pod of a rendered template, its volumes under `root`."""

    def __init__(self, name: str, template: dict, root: Path, objects: dict, secret: dict):
        self.name = name
        self.template = template
        spec = template["spec"]
        (self.container,) = spec["containers"]
        self.mounts: dict[str, Path] = {}
        volumes = {v["name"]: v for v in spec["volumes"]}
        for mount in self.container["volumeMounts"]:
            volume = volumes[mount["name"]]
            folder = root / name / mount["name"]
            if "configMap" in volume:
                data = objects[("ConfigMap", volume["configMap"]["name"])]["data"]
                for item in volume["configMap"]["items"]:
                    path = folder / item["path"]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(data[item["key"]])
            elif "secret" in volume:
                folder.mkdir(parents=True)
                for key, value in secret.items():
                    (folder / key).write_text(value)
                    (folder / key).chmod(volume["secret"]["defaultMode"])
            else:  # emptyDir: /dev/shm stays the host's
                continue
            self.mounts[mount["mountPath"]] = folder
        self.env = container_env(self.container)
        self.process: subprocess.Popen | None = None
        self.log = root / f"{name}.log"

    def path(self, word: str) -> str:
        for mount, folder in self.mounts.items():
            if word == mount or word.startswith(mount + "/"):
                return str(folder) + word[len(mount) :]
        return word

    def argv(self, words: list[str]) -> list[str]:
        return [self.path(expand(w, self.env)) for w in words]

    def process_env(self) -> dict[str, str]:
        base = {
            "PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
        }
        return base | self.env

    def start(self, pods: list[Pod]) -> None:
        args = self.container["args"]
        if self.container["name"] == "router":
            args = selected_workers(args, pods)
        argv = self.argv(self.container["command"] + args)
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=self.process_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,
            )

    def port(self, name_or_number) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        (port,) = [
            p["containerPort"] for p in self.container["ports"] if p["name"] == name_or_number
        ]
        return port

    def probe(self, kind: str) -> tuple[str, int | str]:
        """(URL, status or error) of one of the container's probes, read once."""
        probe = self.container[kind]["httpGet"]
        url = f"http://{POD_IP}:{self.port(probe['port'])}{probe['path']}"
        timeout = self.container[kind]["timeoutSeconds"]
        try:
            with urllib.request.urlopen(url, timeout=timeout) as reply:
                return url, reply.status
        except urllib.error.HTTPError as exc:
            return url, exc.code
        except OSError as exc:
            return url, f"{type(exc).__name__}: {exc}"

    def wait_probe(self, kind: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, f"{self.name} exited:\n{self.tail()}"
            url, status = self.probe(kind)
            if status == 200:
                return
            assert time.monotonic() < deadline, f"{self.name} {kind} {url}: {status}\n{self.tail()}"
            time.sleep(1)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def pre_stop(self) -> subprocess.CompletedProcess:
        hook = self.container["lifecycle"]["preStop"]["exec"]["command"]
        return subprocess.run(
            self.argv(hook),
            cwd=ROOT,
            env=self.process_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def stop(self, grace_s: float = 60) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def pods_of(rendered: list, root: Path, secret: dict) -> list[Pod]:
    """One pod per role of the RoleBasedGroup: every replica of a role runs its one template."""
    objects = {(i.obj["kind"], i.obj["metadata"]["name"]): i.obj for i in rendered}
    pods = []
    for item in rendered:
        if item.obj["kind"] != "RoleBasedGroup":
            continue
        for role in item.obj["spec"]["roles"]:
            template = role["standalonePattern"]["template"]
            pods.append(Pod(role["name"], template, root, objects, secret))
    return pods


def secret_data(opts: k8s.Options, key: str) -> dict[str, str]:
    """The Secret `launch/pd k8s` tells the operator to make, made by running its command with
    kubectl standing in as a function that prints its arguments."""
    script = f'kubectl() {{ printf "%s\\n" "$@"; }}; KEY="$1"; {k8s.secret_command(opts)}'
    done = subprocess.run(
        ["bash", "-c", script, "bash", key], capture_output=True, text=True, check=True
    )
    data = {}
    for line in done.stdout.splitlines():
        if line.startswith("--from-literal="):
            name, _, value = line.removeprefix("--from-literal=").partition("=")
            data[name] = value
    return data
