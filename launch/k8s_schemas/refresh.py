"""Vendor the openAPIV3Schema of every custom resource `launch/pd k8s` renders, at pinned tags.

usage: .venv/bin/python launch/k8s_schemas/refresh.py [--checkout OWNER/NAME=DIR ...]

Each schema is read from its project's CRD file at the tag and commit below: from a local git
clone of that project given with --checkout (`git show COMMIT:PATH`), else over HTTPS from
GitHub's raw file view of the same commit. The served version's openAPIV3Schema is written to
NAME.json here, without its `description` fields (they say nothing a validator reads, and they
are most of the bytes), and SOURCES.json records where each came from. To move to a newer
release, change TAG and COMMIT below, run this, and run tests/launch/test_k8s.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
# (file here, repository, tag, commit, CRD path in the repository, version served)
SOURCES = [
    (
        "rolebasedgroup",
        "sgl-project/rbg",
        "v0.8.0-alpha.5",
        "993491fba9bfdf377d3cd18c8833da20ce0ec87b",
        "config/crd/bases/workloads.x-k8s.io_rolebasedgroups.yaml",
        "v1alpha2",
    ),
    (
        "coordinatedpolicy",
        "sgl-project/rbg",
        "v0.8.0-alpha.5",
        "993491fba9bfdf377d3cd18c8833da20ce0ec87b",
        "config/crd/bases/workloads.x-k8s.io_coordinatedpolicies.yaml",
        "v1alpha2",
    ),
    (
        "disaggregatedset",
        "kubernetes-sigs/lws",
        "v0.9.0",
        "f056f611ae7721f9983ac35f26bfbae8547fd9f3",
        "config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml",
        "v1",
    ),
    (
        "podmonitor",
        "prometheus-operator/prometheus-operator",
        "v0.93.0",
        "f8fafd475f3d132e239432ae6172de60a6cb6516",
        "example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml",
        "v1",
    ),
    (
        "prometheusrule",
        "prometheus-operator/prometheus-operator",
        "v0.93.0",
        "f8fafd475f3d132e239432ae6172de60a6cb6516",
        "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml",
        "v1",
    ),
]


def crd_text(repo: str, commit: str, path: str, checkouts: dict[str, Path]) -> str:
    if repo in checkouts:
        return subprocess.run(
            ["git", "-C", str(checkouts[repo]), "show", f"{commit}:{path}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    url = f"https://raw.githubusercontent.com/{repo}/{commit}/{path}"
    with urllib.request.urlopen(url, timeout=60) as reply:
        return reply.read().decode()


def without_descriptions(node):
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def schema_of(crd: dict, version: str) -> dict:
    for served in crd["spec"]["versions"]:
        if served["name"] == version and served.get("served"):
            return without_descriptions(served["schema"]["openAPIV3Schema"])
    raise SystemExit(f"{crd['metadata']['name']}: no served version {version}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="OWNER/NAME=DIR",
        help="read that repository's CRDs from a local git clone instead of GitHub",
    )
    args = parser.parse_args(argv)
    checkouts = {}
    for item in args.checkout:
        repo, _, folder = item.partition("=")
        checkouts[repo] = Path(folder)
    record = {}
    for name, repo, tag, commit, path, version in SOURCES:
        crd = yaml.safe_load(crd_text(repo, commit, path, checkouts))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        schema = schema_of(crd, version)
        (HERE / f"{name}.json").write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        record[name] = {
            "apiVersion": f"{group}/{version}",
            "kind": kind,
            "repository": f"https://github.com/{repo}",
            "tag": tag,
            "commit": commit,
            "path": path,
        }
        print(f"{name}.json: {kind} {group}/{version} from {repo} {tag} ({commit[:12]}) {path}")
    (HERE / "SOURCES.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
