"""YAML for the objects `launch/pd k8s` renders, with a comment above the fields whose choice
needs a reason (an update or restart strategy, a probe, a grace period).

PyYAML writes no comments, so this writes block YAML itself: mappings and sequences as blocks,
each scalar as PyYAML writes it alone (so its quoting is PyYAML's), multi-line strings (PromQL)
as literal blocks. What it writes reads back, with yaml.safe_load, as the object it was given;
tests/launch/test_k8s.py checks that for every rendered file.
"""

from __future__ import annotations

import textwrap

import yaml

WIDTH = 100


def _scalar(value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, allow_unicode=True)
    text = text.rstrip("\n")
    return text[: -len("\n...")] if text.endswith("\n...") else text


def _literal(value) -> bool:
    """A string written as a literal block: multi-line, and read back the same that way."""
    if not isinstance(value, str) or "\n" not in value.rstrip("\n"):
        return False
    body = value[:-1] if value.endswith("\n") else value
    lines = body.split("\n")
    return (
        not value.endswith("\n\n")
        and all(line == line.rstrip() for line in lines)
        and not lines[0].startswith(" ")
        and "\t" not in value
    )


def _comment(text: str, pad: str) -> list[str]:
    width = max(40, WIDTH - len(pad) - 2)
    return [f"{pad}# {line}" for line in textwrap.wrap(text, width)]


def _key(item, index: int):
    return item.get("name", index) if isinstance(item, dict) else index


def _block(head: str, text: str, pad: str) -> list[str]:
    """`head |` (or `|-` without a final newline) and text's lines as a literal block."""
    body = text[:-1] if text.endswith("\n") else text
    lines = [f"{head} |{'' if text.endswith(chr(10)) else '-'}"]
    return lines + [f"{pad}  {line}" if line else "" for line in body.split("\n")]


def _lines(node, indent: int, path: tuple, comments: dict) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            here = (*path, key)
            if here in comments:
                out += _comment(comments[here], pad)
            head = f"{pad}{_scalar(key)}:"
            if isinstance(value, dict) and value:
                out.append(head)
                out += _lines(value, indent + 2, here, comments)
            elif isinstance(value, list) and value:
                out.append(head)
                out += _lines(value, indent, here, comments)
            elif _literal(value):
                out += _block(head, value, pad)
            else:
                out.append(f"{head} {_scalar(value)}")
        return out
    for index, item in enumerate(node):
        here = (*path, _key(item, index))
        if isinstance(item, (dict, list)) and item:
            inner = _lines(item, indent + 2, here, comments)
            first = next(i for i, line in enumerate(inner) if not line.lstrip().startswith("#"))
            inner[first] = f"{pad}- {inner[first][indent + 2 :]}"
            out += inner
        elif _literal(item):
            out += _block(f"{pad}-", item, pad)
        else:
            out.append(f"{pad}- {_scalar(item)}")
    return out


def dump(obj: dict, comments: dict | None = None, head: str = "") -> str:
    """One YAML document. comments: {path: text}, a path being the keys down to a field, a list
    item named by its `name` (("spec", "roles", "decode", "rolloutStrategy"))."""
    top = [f"# {line}" for line in head.splitlines()]
    return "\n".join(top + _lines(obj, 0, (), comments or {})) + "\n"
