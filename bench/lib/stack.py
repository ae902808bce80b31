"""Where the router and the engines of a PD stack listen."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Stack:
    router_url: str | None = None
    prefill_url: str | None = None
    decode_url: str | None = None

    def engines(self) -> list[tuple[str, str]]:
        return [
            (role, url)
            for role, url in (("prefill", self.prefill_url), ("decode", self.decode_url))
            if url
        ]


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as launch/pd reads them: '#' comments, optional 'export', quotes."""
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].strip()
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{path}:{number}: not a KEY=VALUE line: {raw!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def _http_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"wants an http://HOST:PORT URL, got {text!r}")
    return text.rstrip("/")


def add_stack_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("stack (where the router and engines listen)")
    group.add_argument("--router-url", type=_http_url, help="router URL")
    group.add_argument("--prefill-url", type=_http_url, help="prefill engine URL")
    group.add_argument("--decode-url", type=_http_url, help="decode engine URL")
    group.add_argument(
        "--env-dir",
        type=Path,
        help="read the URLs the options above leave unset from this env "
        "directory (common.env, prefill.env, decode.env, router.env)",
    )


def _find(values: dict[str, str], role: str, suffix: str, exclude: str = "") -> str | None:
    for key, value in values.items():
        if role in key and key.endswith(suffix) and not (exclude and exclude in key) and value:
            return value
    return None


def stack_from_env_dir(env_dir: Path) -> Stack:
    """URLs from the env files: per role a <ROLE>..._PORT key and an optional <ROLE>..._HOST key.

    Role files may override common.env. The bootstrap port is not an HTTP port and is skipped.
    """
    values: dict[str, str] = {}
    for name in ("common.env", "prefill.env", "decode.env", "router.env"):
        path = env_dir / name
        if path.is_file():
            values.update(read_env_file(path))
    if not values:
        raise ValueError("no common.env, prefill.env, decode.env or router.env here")
    default_host = values.get("HOST") or "127.0.0.1"
    urls = []
    for role in ("ROUTER", "PREFILL", "DECODE"):
        port = _find(values, role, "_PORT", exclude="BOOTSTRAP")
        if port is None or not port.isdigit():
            raise ValueError(f"no {role}..._PORT with a port number in the env files")
        host = _find(values, role, "_HOST") or default_host
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        urls.append(f"http://{host}:{port}")
    return Stack(*urls)


def stack_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Stack:
    base = Stack()
    if args.env_dir is not None:
        if not args.env_dir.is_dir():
            parser.error(f"--env-dir {args.env_dir}: not a directory")
        try:
            base = stack_from_env_dir(args.env_dir)
        except (OSError, ValueError) as exc:
            parser.error(f"--env-dir {args.env_dir}: {exc}")
    return Stack(
        args.router_url or base.router_url,
        args.prefill_url or base.prefill_url,
        args.decode_url or base.decode_url,
    )
