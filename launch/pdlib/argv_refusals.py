"""Everything an argparse parser refuses in one command line, not only the first refusal.

argparse stops at the first bad flag or value, so each refused flag (and its value) is taken out
and the rest parsed again, until the line parses. Used for sglang's engine flags
(engine_args.py) and smg's router flags (router_args.py, which runs this file under smg's own
interpreter): only the standard library is imported here.
"""

from __future__ import annotations

import re
from collections.abc import Callable


def peel(
    parse: Callable[[list[str]], object], argv: list[str], refused: type[Exception]
) -> tuple[list[tuple[str | None, str]], object | None]:
    """([(flag, argparse's message)] for every refusal, the namespace of the line once it
    parses, or None when a refusal could not be taken out)."""
    rest = list(argv)
    found: list[tuple[str | None, str]] = []
    for _ in range(len(argv) + 1):
        try:
            return found, parse(rest)
        except refused as err:
            message = str(err)
            flag = flag_in(message, rest)
            found.append((flag, message))
            if flag is None or flag not in rest:
                break
            at = refused_at(rest, flag, message)
            takes_value = at + 1 < len(rest) and not rest[at + 1].startswith("-")
            del rest[at : at + (2 if takes_value else 1)]
    return found, None


def refused_at(argv: list[str], flag: str, message: str) -> int:
    """Index of the refused occurrence of flag: the one whose value the message quotes."""
    places = [i for i, word in enumerate(argv) if word == flag]
    bad = re.search(r"invalid [\w ]+?: '([^']*)'", message)
    for i in places:
        if bad and i + 1 < len(argv) and argv[i + 1] == bad.group(1):
            return i
    return places[0]


def flag_in(message: str, argv: list[str]) -> str | None:
    """The flag an argparse error message is about."""
    if message.startswith("unrecognized arguments:"):
        words = message.split(":", 1)[1].split()
        return next((w for w in words if w.startswith("-")), words[0] if words else None)
    if message.startswith("argument "):
        names = message[len("argument ") :].split(":", 1)[0].split("/")
        return next((n for n in names if n in argv), names[0])
    return None
