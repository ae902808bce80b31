"""Render launch/systemd/*.service.in into one unit per instance for this checkout and env dir."""

from __future__ import annotations

from pathlib import Path

from launch.pdlib.stack import ROOT, Role, Stack

TEMPLATES = ROOT / "launch" / "systemd"
# Engines start after the roles they need on the same host; the router after both engines.
NEEDS = {"prefill": (), "decode": ("prefill",), "router": ("prefill", "decode")}


def unit_name(prefix: str, role: Role) -> str:
    return f"{prefix}-{role.key}.service"


def render(out: Path, stack: Stack, roles: list[Role], sim: bool) -> list[Path]:
    prefix = stack.unit_prefix
    env_dir = stack.env.path.resolve()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for role in roles:
        after = [
            unit_name(prefix, r)
            for r in stack.roles.values()
            if r.kind in NEEDS[role.kind] and r.local
        ]
        instance = role.index is not None
        fields = {
            "@ROOT@": str(ROOT),
            "@ENV_DIR@": str(env_dir),
            "@PREFIX@": prefix,
            "@SIM_FLAG@": " --sim" if sim else "",
            "@AFTER@": "".join(f" {u}" for u in after),
            "@INSTANCE_NAME@": f", instance {role.name}" if instance else "",
            "@INSTANCE_ENV@": f"\nEnvironmentFile={env_dir}/{role.kind}.{role.index}.env"
            if instance
            else "",
            "@INSTANCE_FLAG@": f" --instance {role.index}" if instance else "",
        }
        text = (TEMPLATES / f"{role.kind}.service.in").read_text()
        for field, value in fields.items():
            text = text.replace(field, value)
        path = out / unit_name(prefix, role)
        path.write_text(text)
        written.append(path)
    return written
