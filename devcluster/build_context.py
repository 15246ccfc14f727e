"""The files a container build sends to the builder, as ``.dockerignore`` selects them.

The image cache is keyed by what goes into a build, so the key must cover exactly the
files the builder sees: :func:`context_files` applies ``.dockerignore`` the way Docker
does (patterns are anchored at the context root, ``**`` spans folders, a pattern that
matches a folder matches everything below it, ``!`` takes files back, the last matching
line wins).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_GLOB = re.compile(r"[*?\[\\]")


@dataclass(frozen=True)
class Rule:
    """One line of ``.dockerignore``."""

    pattern: str
    regex: re.Pattern[str]
    include: bool
    """A ``!`` line: takes matching files back into the context."""


def _translate(pattern: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        elif c == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1:end]
            if body.startswith(("!", "^")):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def parse_rules(text: str) -> list[Rule]:
    """The rules of a ``.dockerignore`` file's ``text``."""
    rules: list[Rule] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = os.path.normpath(line[1:].strip() if include else line).lstrip("/")
        if pattern in ("", "."):
            continue
        rules.append(Rule(pattern, re.compile(_translate(pattern)), include))
    return rules


def excluded(path: str, rules: Iterable[Rule]) -> bool:
    """Whether the context leaves out ``path`` (relative, ``/``-separated).

    A rule matches a path when it matches the path itself or any folder above it.
    """
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    left_out = False
    for rule in rules:
        if any(rule.regex.fullmatch(p) for p in prefixes):
            left_out = not rule.include
    return left_out


def _may_take_back(folder: str, rules: list[Rule]) -> bool:
    """Whether some ``!`` rule could match a path below ``folder``."""
    for rule in rules:
        if not rule.include:
            continue
        literal = _GLOB.split(rule.pattern, maxsplit=1)[0]
        if literal.startswith(folder + "/") or (folder + "/").startswith(literal):
            return True
    return False


def context_files(root: Path) -> list[str]:
    """Every file (or symlink) under ``root`` that its ``.dockerignore`` lets into a
    build context, as sorted relative paths."""
    ignore = root / ".dockerignore"
    rules = parse_rules(ignore.read_text()) if ignore.is_file() else []
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        rel_folder = os.path.relpath(folder, root)
        rel_folder = "" if rel_folder == "." else rel_folder + "/"
        links = [d for d in dirs if os.path.islink(os.path.join(folder, d))]
        # Descending into a left-out folder is wasted unless a "!" line may reach into it.
        dirs[:] = [d for d in dirs
                   if d not in links and not (excluded(rel_folder + d, rules)
                                              and not _may_take_back(rel_folder + d, rules))]
        for name in (*files, *links):
            rel = rel_folder + name
            if not excluded(rel, rules):
                found.append(rel)
    return sorted(found)


def digest_files(root: Path, paths: Iterable[str]) -> str:
    """A sha256 over the names, executable bits and contents (link targets for symlinks)
    of ``paths`` under ``root``."""
    digest = hashlib.sha256()
    for rel in paths:
        path = root / rel
        digest.update(rel.encode() + b"\0")
        if path.is_symlink():
            digest.update(b"link\0" + os.readlink(path).encode())
        else:
            digest.update(b"x\0" if os.access(path, os.X_OK) else b"-\0")
            with path.open("rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
        digest.update(b"\0")
    return digest.hexdigest()
