"""Reading deploy/docker/Dockerfile and .dockerignore the way `docker build` does (the subset used).

No container engine runs here, so the tests read the build files instead: a Dockerfile becomes
its instructions grouped by stage (continuation lines joined, comment lines dropped, as the
Dockerfile frontend does), and `.dockerignore` answers whether a path of the build context
reaches the builder (the last matching pattern wins; a pattern that matches a directory
matches everything below it; `!` re-includes; `*` stays within one path segment, `**` spans any).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"  # beside the build context's root, the repository root


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ENV, ...
    value: str  # the rest of the logical line, continuations joined
    line: int  # 1-based line where it starts


@dataclass
class Stage:
    base: str  # FROM's image, as written (may be an ${ARG})
    name: str | None  # FROM ... AS name
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        """The stage's ENV values (KEY=value pairs; later wins)."""
        values: dict[str, str] = {}
        for instruction in self.all("ENV"):
            for pair in shlex.split(instruction.value):
                key, sep, value = pair.partition("=")
                assert sep, f"line {instruction.line}: ENV in the legacy 'KEY value' form: {instruction.value!r}"
                values[key] = value
        return values


def instructions(text: str) -> list[Instruction]:
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # blank and comment lines, also inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        logical = " ".join(pending)
        pending = []
        keyword, _, value = logical.partition(" ")
        out.append(Instruction(keyword.upper(), value.strip(), start))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return out


def global_args(parsed: list[Instruction]) -> dict[str, str]:
    """ARGs before the first FROM (usable in FROM lines) with their defaults."""
    values = {}
    for instruction in parsed:
        if instruction.keyword == "FROM":
            break
        if instruction.keyword == "ARG":
            key, _, default = instruction.value.partition("=")
            values[key] = default
    return values


def stages(parsed: list[Instruction]) -> list[Stage]:
    out: list[Stage] = []
    for instruction in parsed:
        if instruction.keyword == "FROM":
            words = [w for w in instruction.value.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            out.append(Stage(base=words[0], name=name))
        elif out:
            out[-1].instructions.append(instruction)
    return out


def copy_sources(instruction: Instruction) -> tuple[dict[str, str], list[str]]:
    """(--flags, sources) of a COPY/ADD, in shell or JSON form (the destination left out)."""
    value = instruction.value
    flags = {}
    while value.startswith("--"):
        flag, _, value = value.partition(" ")
        key, _, flag_value = flag[2:].partition("=")
        flags[key] = flag_value
        value = value.strip()
    words = json.loads(value) if value.startswith("[") else value.split()
    return flags, words[:-1]


def exec_form(instruction: Instruction) -> list[str]:
    """ENTRYPOINT/CMD in JSON (exec) form."""
    assert instruction.value.startswith("["), f"line {instruction.line}: {instruction.keyword} is not in exec form"
    return json.loads(instruction.value)


# ---- .dockerignore ------------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore_patterns(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(is_exception, regex) per pattern line, in order."""
    patterns = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        cleaned = line.lstrip("!").strip().strip("/")
        patterns.append((exception, _pattern_regex(cleaned)))
    return patterns


def is_ignored(path: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether `path` (relative to the context root, '/'-separated) is left out of the context."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]  # the path and its parent directories
    ignored = False
    for exception, regex in patterns:
        if any(regex.fullmatch(p) for p in prefixes):
            ignored = not exception
    return ignored
