"""Every object `launch/pd k8s` renders, checked against the schema its API server would apply.

Custom resources (RoleBasedGroup, CoordinatedPolicy, DisaggregatedSet, PodMonitor,
PrometheusRule) against the openAPIV3Schema of their projects' CRDs at pinned tags, vendored in
launch/k8s_schemas/ (refresh.py there names each tag, commit and file). Core kinds (ConfigMap,
Service, Deployment, ServiceAccount, Role, RoleBinding), and every pod template inside a custom
resource, with kubernetes-validate (PyPI), which bundles the Kubernetes API's own JSON schemas
per release and works offline, in its strict mode (a field the API does not have is an error).

What an API server would do and this does not: CEL rules (`x-kubernetes-validations`, e.g.
RBG's "standalonePattern and leaderWorkerPattern are mutually exclusive"), admission webhooks,
defaulting. Unknown fields are refused here as `kubectl apply`'s strict field validation refuses
them: every object schema that lists its properties and does not preserve unknown fields gets
`additionalProperties: false`.
"""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import kubernetes_validate

from launch.pdlib.stack import ROOT

SCHEMAS = ROOT / "launch" / "k8s_schemas"
# The Kubernetes release whose core schemas the core kinds are checked against.
KUBERNETES_VERSION = "1.33.0"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Keys under which a custom resource embeds a core pod template.
POD_TEMPLATE_KEYS = ("template", "leaderTemplate", "workerTemplate")


def strict(schema):
    """The schema with unknown fields refused wherever the CRD does not preserve them."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def sources() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the vendored schema's record (SOURCES.json) with its file name."""
    record = json.loads((SCHEMAS / "SOURCES.json").read_text())
    return {(r["apiVersion"], r["kind"]): {**r, "file": name} for name, r in record.items()}


@functools.cache
def _validator(name: str) -> jsonschema.Draft7Validator:
    schema = strict(json.loads((SCHEMAS / f"{name}.json").read_text()))
    return jsonschema.Draft7Validator(schema)


def _where(path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path) or "."


def _core(obj: dict, label: str) -> list[str]:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{label}: {_where(exc.path)}: {exc.message} (Kubernetes {KUBERNETES_VERSION})"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"{label}: no Kubernetes {KUBERNETES_VERSION} schema for {obj.get('kind')}"]
    return []


def _pod_templates(node, path=()):
    """(path, pod template) for every pod template a custom resource embeds."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in POD_TEMPLATE_KEYS and isinstance(value, dict) and "spec" in value:
                yield (*path, key), value
            else:
                yield from _pod_templates(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _pod_templates(value, (*path, i))


def problems(obj: dict) -> list[str]:
    """What an API server's schema check would refuse in obj, one line each."""
    kind, version = obj.get("kind", "?"), obj.get("apiVersion", "?")
    name = (obj.get("metadata") or {}).get("name", "")
    label = f"{kind} {name}"
    found = []
    if not DNS_SUBDOMAIN.match(name) or len(name) > 253:
        found.append(f"{label}: metadata.name {name!r} is not a DNS subdomain")
    source = sources().get((version, kind))
    if source is None:
        return found + _core(obj, label)
    for error in sorted(_validator(source["file"]).iter_errors(obj), key=lambda e: list(e.path)):
        found.append(
            f"{label}: {_where(error.absolute_path)}: {error.message} "
            f"({source['repository']} {source['tag']})"
        )
    for path, template in _pod_templates(obj.get("spec", {}), ("spec",)):
        wrapped = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "template"},
            "template": template,
        }
        found += _core(wrapped, f"{label} {_where(path)}")
    return found
