"""Where the router and the engines of a PD stack listen."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from launch.pdlib.stack import load_stack

# A bind address is not an address to connect to; clients reach a wildcard bind on loopback.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


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
        help="read the URLs the options above leave unset from this env directory "
        "(ROUTER_HOST/ROUTER_PORT, PREFILL_HOST/PREFILL_PORT, DECODE_HOST/DECODE_PORT) "
        "(default: the repository's env/, as bench/ab)",
    )


def _client_url(host: str, port: int) -> str:
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def stack_from_env_dir(env_dir: Path) -> Stack:
    """The URLs launch/pd starts the roles on, read the way launch/pd reads them.

    Raises ValueError (launch's EnvFileError) for a missing file, a bad line or an unset
    <ROLE>_HOST / <ROLE>_PORT.
    """
    roles = load_stack(Path(env_dir), sim=False).roles
    return Stack(
        *(_client_url(roles[r].host, roles[r].port) for r in ("router", "prefill", "decode"))
    )


DEFAULT_ENV_DIR = Path(__file__).resolve().parents[2] / "env"


def stack_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Stack:
    base = Stack()
    if args.env_dir is None and DEFAULT_ENV_DIR.is_dir():
        args.env_dir = DEFAULT_ENV_DIR
    if args.env_dir is not None:
        if not args.env_dir.is_dir():
            parser.error(f"--env-dir {args.env_dir}: not a directory")
        try:
            base = stack_from_env_dir(args.env_dir)
        except (OSError, ValueError) as exc:
            # launch's messages already name the directory or the file and line.
            parser.error(str(exc))
    return Stack(
        args.router_url or base.router_url,
        args.prefill_url or base.prefill_url,
        args.decode_url or base.decode_url,
    )
