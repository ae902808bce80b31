"""Where the router and the engines of a PD stack listen."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from launch.pdlib.stack import load_stack

# A bind address is not an address to connect to; clients reach a wildcard bind on loopback.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class Stack:
    """The router's URL, the first prefill's and decode's, and every engine instance by name
    (prefill, or prefill/1 and prefill/2 of several, as launch/pd names them)."""

    router_url: str | None = None
    prefill_url: str | None = None
    decode_url: str | None = None
    instances: tuple[tuple[str, str], ...] = ()

    def engines(self) -> list[tuple[str, str]]:
        """(instance name, URL) of every prefill, then every decode."""
        if self.instances:
            return list(self.instances)
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
    for kind in ("prefill", "decode"):
        group.add_argument(
            f"--{kind}-url",
            type=_http_url,
            action="append",
            help=f"{kind} engine URL; repeat it for several instances ({kind}/1, {kind}/2, ...). "
            f"Given, it replaces every {kind} instance of the env directory",
        )
    group.add_argument(
        "--env-dir",
        type=Path,
        help="read the URLs the options above leave unset from this env directory "
        "(ROUTER_HOST/ROUTER_PORT, PREFILL_HOST/PREFILL_PORT, DECODE_HOST/DECODE_PORT, and "
        "every instance file's) (default: the repository's env/, as bench/ab)",
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
    stack = load_stack(Path(env_dir), sim=False)
    engines = tuple(
        (role.name, _client_url(role.host, role.port))
        for kind in KINDS
        for role in stack.of_kind(kind)
    )
    first = {kind: next(url for name, url in engines if name.startswith(kind)) for kind in KINDS}
    router = stack.roles["router"]
    return Stack(_client_url(router.host, router.port), first["prefill"], first["decode"], engines)


def _named(kind: str, urls: list[str]) -> tuple[tuple[str, str], ...]:
    if len(urls) == 1:
        return ((kind, urls[0]),)
    return tuple((f"{kind}/{i}", url) for i, url in enumerate(urls, 1))


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
    engines = []
    for kind in KINDS:
        given = getattr(args, f"{kind}_url")
        if given:
            engines += _named(kind, given)
        else:
            engines += [(name, url) for name, url in base.engines() if name.startswith(kind)]
    first = {kind: next((u for n, u in engines if n.startswith(kind)), None) for kind in KINDS}
    return Stack(
        args.router_url or base.router_url, first["prefill"], first["decode"], tuple(engines)
    )
