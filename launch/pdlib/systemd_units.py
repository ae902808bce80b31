"""Render launch/systemd/*.service.in into unit files for this checkout and env dir."""

from __future__ import annotations

from pathlib import Path

from launch.pdlib.envfiles import ROLES, EnvDir
from launch.pdlib.stack import ROOT

TEMPLATES = ROOT / "launch" / "systemd"


def render(out: Path, env_dir: Path, sim: bool) -> list[Path]:
    env = EnvDir(env_dir)
    prefix = env.common().get("PD_UNIT_PREFIX") or "sm120pd"
    fields = {
        "@ROOT@": str(ROOT),
        "@ENV_DIR@": str(Path(env_dir).resolve()),
        "@PREFIX@": prefix,
        "@SIM_FLAG@": " --sim" if sim else "",
    }
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for role in ROLES:
        text = (TEMPLATES / f"{role}.service.in").read_text()
        for field, value in fields.items():
            text = text.replace(field, value)
        path = out / f"{prefix}-{role}.service"
        path.write_text(text)
        written.append(path)
    return written
