"""`pip install dspark` without extras gives a working `dspark` command.

The README's first command installs the core dependencies only, then runs `dspark serve`; every
`dspark` command builds one parser with every subcommand registered, so a module imported while
registering any of them that needs an extra (pytest, matplotlib, the prompt datasets, ...)
breaks them all on a fresh machine, while a test run, which has the extras, never notices
(it happened once, with httpx). Here a fresh interpreter is forbidden every module that only an
extra brings, and must still build the parser and answer `--help`.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest
from packaging.requirements import Requirement


def _normalised(distribution: str) -> str:  # PEP 503: "PyYAML", "pyyaml" and "py_yaml" are one name
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _name(requirement: str) -> str:
    return _normalised(Requirement(requirement).name)


def _installed_closure(roots: list[str]) -> set[str]:
    """Distributions the root requirements pull in, transitively (unconditional requirements only)."""
    seen: set[str] = set()
    todo = [_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for req in map(Requirement, requires):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_name(str(req)))
    return seen


def modules_only_extras_bring() -> set[str]:
    dspark = metadata.metadata("dspark")
    core = [r for r in dspark.get_all("Requires-Dist") or [] if "extra ==" not in r]
    extras = [r.split(";")[0] for r in dspark.get_all("Requires-Dist") or [] if "extra ==" in r]
    only_extras = _installed_closure(extras) - _installed_closure(core) - {"dspark"}
    return {module for module, dists in metadata.packages_distributions().items()
            if {_normalised(d) for d in dists} <= only_extras}


def test_the_extras_bring_modules_the_core_does_not():  # else the check below checks nothing
    blocked = modules_only_extras_bring()
    assert {"pytest", "matplotlib", "schemathesis"} <= blocked
    assert not {"torch", "httpx", "fastapi", "yaml"} & blocked  # core, or pulled in by the core (transformers: yaml)


@pytest.mark.processes
def test_every_dspark_command_parses_with_the_core_dependencies_only():
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        BLOCKED = {sorted(modules_only_extras_bring())!r}

        class ExtrasAreNotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (an extra)", name=name)
                return None

        sys.meta_path.insert(0, ExtrasAreNotInstalled())
        from dspark.cli import build_parser
        parser = build_parser()
        for argv in (["--help"], ["serve", "--help"], ["generate", "--help"]):
            try:
                parser.parse_args(argv)
            except SystemExit as e:
                assert e.code == 0, argv
        print("parsed")
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("parsed"), done.stderr[-3000:]
