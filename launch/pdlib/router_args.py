"""The router's command line read with smg's own parser (`smg/router_args.py` of the installed smg).

`smg launch` hands everything after `launch` to `RouterArgs.add_cli_args` on a plain argparse
parser and reads the result back with `RouterArgs.from_cli_args`. `env check` does the same with
the smg that SMG_BIN runs, so a misspelled flag in ROUTER_ARGS (`--worker-overlod-shed`) is named
before any engine loads, not when the router refuses to start after them; bench/ab reads both
arms' routers the same way to compare their settings.

The parser runs under smg's own interpreter (the #! line of SMG_BIN), in a subprocess running
this file: `python router_args.py refusals|settings|secret-flags ARG...` prints JSON. Only the
standard library is imported here, so that interpreter needs nothing of this repository.

What the answers never carry: the value of a secret-bearing flag (`secret_bearing`, a rule read
off smg's parser). `settings` gives such a value as a fingerprint, the same for the same value
within one process that asks (bench/ab compares both arms' routers by it), and a refusal's
message names the flag without its value. `secret-flags` names those flags, so that a caller
can strip the words a command line gives them from text it did not build (`secret_words`).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

try:
    from launch.pdlib import argv_refusals
except ImportError:  # run as a script under smg's Python: the file next to this one
    import argv_refusals

ROOT = Path(__file__).resolve().parents[2]
# Where a router listens and its key: they differ between stacks by design, not by routing.
NOT_ROUTING = frozenset({"host", "port", "prometheus_host", "prometheus_port", "api_key"})
REDACTED = "<redacted>"
# What a flag's names, metavar or help say when its value can be a secret. The stems mean one
# wherever they appear (`--oracle-password`, `--client-secret`, `apikey`, a connection URL or
# DSN, which carry a database's password); "key" and "token" only as whole words (a key file, an
# API key, an auth token), so that `tokenizer` and `keyed` are not.
_SECRET_STEMS = re.compile(r"passw|passphrase|secret|credential|apikey|connection|dsn", re.I)
_SECRET_WORDS = re.compile(r"(?<![a-z])(keys?|tokens?)(?![a-z])", re.I)
# A URL with a user part (`postgresql://user:password@host/db`), whichever flag it is given to.
_URL_USERINFO = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s@]*@", re.I)
# The key of settings' fingerprints: one per asking process, handed to the child that answers.
_FINGERPRINT_ENV = "SM120PD_FINGERPRINT_KEY"
_FINGERPRINT_KEY = secrets.token_hex(16)


class RouterArgsError(ValueError):
    """The router's command line could not be read, or smg could not be asked about it."""


class _Refused(Exception):
    pass


def _parser():
    from smg.router_args import RouterArgs

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # argparse would print usage and exit
            raise _Refused(message)

    parser = Parser(prog="smg launch", add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return parser, RouterArgs


def secret_bearing(action: argparse.Action) -> bool:
    """Whether a flag of smg's parser may carry a secret, so that its value is never written.

    The rule fails closed: a flag whose option strings, dest, metavar or help say password,
    passphrase, secret, credential, apikey, connection or DSN anywhere, or key(s) or token(s)
    as a word, is secret-bearing, whatever smg calls it next release. Three kinds of flag are let
    off, because their value cannot hold a secret whatever their help says: one that takes no value
    (`store_true` and the like), one whose value must be one of smg's own `choices`, and one
    that smg's parser turns into a number (`type=int` or `float`: a count, a size, a rate; the
    routers' "token usage" thresholds are these). A flag with a converter of smg's own
    (`--cache-boundaries`) is taken as text. So `--api-key`, `--tenant-api-key`,
    `--control-plane-api-keys`, `--oracle-password`, the TLS key paths and the database URLs
    are secret-bearing, and so, harmlessly, are a few routing flags whose help says "key" or
    "token" (`--routing-key-headers`): their values are compared by fingerprint, not shown.
    Whatever the flag, a URL with a user part (`scheme://user:password@`) is kept out too."""
    if action.nargs == 0 or action.choices is not None or action.type in (int, float):
        return False
    said = " ".join(
        [*action.option_strings, action.dest, str(action.metavar or ""), action.help or ""]
    )
    return bool(_SECRET_STEMS.search(said) or _SECRET_WORDS.search(said))


def _secret_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and secret_bearing(a)]


def secret_flags() -> dict[str, object]:
    """{"secret": {dest: option strings} of every secret-bearing flag of smg's parser, "other":
    the option strings of the rest} (under smg's Python)."""
    parser, _ = _parser()
    secret = _secret_actions(parser)
    other = [o for a in parser._actions if a not in secret for o in a.option_strings]
    return {"secret": {a.dest: list(a.option_strings) for a in secret}, "other": other}


def secret_words(secret: list[str], other: list[str], argv: list[str]) -> list[str]:
    """The words of argv given to a secret-bearing flag (secret: their option strings, other:
    those of the rest, as secret_flags gives them), longest first: `--flag=VALUE`, or the words
    after `--flag` up to the next option. A word that is no flag's own name but begins one of
    them is taken for that flag, as allow_abbrev does (when it is ambiguous argparse refuses it,
    and it still counts). Any word with a URL's user part is one too."""
    words: list[str] = [w for w in argv if _URL_USERINFO.search(w)]
    for i, word in enumerate(argv):
        name, eq, value = word.partition("=")
        if len(name) < 3 or not name.startswith("--") or name in other:
            continue
        if not any(o.startswith(name) for o in secret):
            continue
        if eq:
            words.append(value)
            continue
        for following in argv[i + 1 :]:
            if following.startswith("-"):
                break
            words.append(following)
    return sorted({w for w in words if w}, key=len, reverse=True)


def _secret_words(argv: list[str]) -> list[str]:
    flags = secret_flags()
    return secret_words([o for n in flags["secret"].values() for o in n], flags["other"], argv)


def _redact_message(message: str, words: list[str]) -> str:
    """argparse's or smg's message without a secret word; in "unrecognized arguments: ..." only
    the option names stay (a misspelt secret flag's value is not known to be secret)."""
    for word in words:
        message = message.replace(word, REDACTED)
    head, sep, rest = message.partition("unrecognized arguments:")
    if sep:
        shown = [w if w.startswith("-") else REDACTED for w in rest.split()]
        shown = [w.partition("=")[0] + "=" + REDACTED if "=" in w else w for w in shown]
        message = f"{head}{sep} {' '.join(shown)}"
    return message


def _fingerprint(value: object) -> str:
    key = os.environ.get(_FINGERPRINT_ENV, _FINGERPRINT_KEY).encode()
    text = json.dumps(value, sort_keys=True, default=str).encode()
    return f"<redacted {hmac.new(key, text, hashlib.sha256).hexdigest()[:12]}>"


def _shown_flag(flag: str | None) -> str | None:
    """A refused flag as a message may name it: an option name, never a value."""
    if flag is None:
        return None
    if not flag.startswith("-"):
        return REDACTED
    name, eq, _ = flag.partition("=")
    return f"{name}={REDACTED}" if eq else name


def smg_refusals(argv: list[str]) -> list[list[str | None]]:
    """[[flag, message]] for everything smg's parser refuses in argv (run under smg's Python);
    a line that parses is then read back as smg does (from_cli_args). No secret word is in a
    message, and a flag that is not an option name is not shown."""
    parser, router_args = _parser()
    refused, namespace = argv_refusals.peel(parser.parse_args, argv, _Refused)
    found: list[tuple[str | None, str]] = list(refused)
    if not found and namespace is not None:
        try:
            router_args.from_cli_args(namespace, use_router_prefix=False)
        except Exception as exc:  # noqa: BLE001 - smg's own reading of the values failed
            found.append((None, f"{type(exc).__name__}: {exc}"))
    words = _secret_words(argv)
    return [[_shown_flag(flag), _redact_message(message, words)] for flag, message in found]


def smg_settings(argv: list[str]) -> dict[str, object]:
    """Every setting smg reads from argv, defaults included, a secret-bearing flag's value (when
    set) as its fingerprint (run under smg's Python)."""
    parser, _ = _parser()
    words = _secret_words(argv)
    try:
        namespace = parser.parse_args(argv)
    except _Refused as err:
        raise RouterArgsError(
            "smg's parser refuses the router's command line: " + _redact_message(str(err), words)
        ) from err
    secret = {a.dest for a in _secret_actions(parser)}

    def hidden(key: str, value: object) -> bool:
        if value in (None, "", [], {}):
            return False
        return key in secret or bool(_URL_USERINFO.search(json.dumps(value, default=str)))

    return {
        k: _fingerprint(v) if hidden(k, v) else v
        for k, v in sorted(vars(namespace).items())
        if k not in NOT_ROUTING
    }


def settings_differences(a: dict | None, b: dict | None) -> list[str]:
    """'--flag: A x, B y' for each routing setting in which two routers differ."""
    if not a or not b or a.get("settings") is None or b.get("settings") is None:
        return []
    sa, sb = a["settings"], b["settings"]
    return [
        f"--{key.replace('_', '-')}: A {sa.get(key)!r}, B {sb.get(key)!r}"
        for key in sorted(set(sa) | set(sb))
        if sa.get(key) != sb.get(key)
    ]


def find_smg_bin(value: str, search_path: str | None = None) -> Path | None:
    """The file launch/router.sh runs for SMG_BIN=value (`from_root` in launch/lib.sh): an
    absolute path as it is, a path with a slash under the repository root, a bare name looked
    up on search_path (the router's PATH; None: this process's), None when no directory of it
    has an executable of that name."""
    if value.startswith("/"):
        return Path(value)
    if "/" in value:
        return ROOT / value
    found = shutil.which(value, path=search_path)
    return Path(found) if found else None


def smg_python(smg_bin: Path) -> str:
    """The interpreter smg is installed in: the #! line of its console script, else this one."""
    try:
        with smg_bin.open("rb") as f:
            first = f.readline(512).decode(errors="replace").strip()
    except OSError:
        return sys.executable
    found = re.fullmatch(r"#!(/\S*python\S*)", first)
    return found.group(1) if found else sys.executable


def ask_smg(python: str, verb: str, argv: list[str]):
    """Run smg_refusals or smg_settings under smg's interpreter; RouterArgsError when it cannot."""
    try:
        done = subprocess.run(
            [python, str(Path(__file__).resolve()), verb, *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, _FINGERPRINT_ENV: _FINGERPRINT_KEY},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RouterArgsError(f"{python} could not run smg's parser: {exc}") from exc
    if done.returncode == 3:
        raise RouterArgsError(f"smg is not installed for {python}")
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RouterArgsError(tail)
    return json.loads(done.stdout)


@functools.lru_cache
def flag_names(python: str) -> tuple[list[str], list[str]]:
    """(the option strings of every secret-bearing flag, those of the rest) of the smg
    installed for python, for secret_words."""
    flags = ask_smg(python, "secret-flags", [])
    return [o for names in flags["secret"].values() for o in names], flags["other"]


def router_command(env_dir: Path) -> list[str]:
    """The command launch/router.sh starts smg with for this env dir (its --dry-run, parsed)."""
    import shlex

    done = subprocess.run(
        ["bash", str(ROOT / "launch" / "router.sh"), "--env-dir", str(env_dir), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        raise RouterArgsError(done.stderr.strip() or "launch/router.sh --dry-run failed")
    lines = done.stdout.splitlines()
    return shlex.split(lines[lines.index("# command") + 1])


def launch_args(command: list[str]) -> list[str]:
    """What smg's router parser gets from a command line: the words after `launch`."""
    if "launch" not in command:
        raise RouterArgsError(f"not an `smg launch` command line: {' '.join(command[:4])} ...")
    return command[command.index("launch") + 1 :]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("refusals", "settings", "secret-flags"):
        print("usage: router_args.py refusals|settings|secret-flags ARG...", file=sys.stderr)
        return 2
    try:
        import smg.router_args  # noqa: F401
    except ImportError:
        return 3
    try:
        if argv[0] == "secret-flags":
            result: object = secret_flags()
        else:
            result = (smg_refusals if argv[0] == "refusals" else smg_settings)(argv[1:])
    except RouterArgsError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
