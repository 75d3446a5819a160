"""COVERAGE.md names, for each Lightning test function, the test here that replays its promise:
every named test must exist -- its file, its function, and for a ``test_section[...]`` row a section
the test file runs and its program defines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
NAMED = re.compile(r"`(tests/lightning_conformance/[\w/]+\.py)::(\w+)(?:\[(\w+)\])?`")


def _strings_and_functions(path: Path) -> tuple[set[str], set[str]]:
    tree = ast.parse(path.read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    return strings, functions


def test_every_named_counterpart_exists() -> None:
    table = (HERE / "COVERAGE.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| `test_")]
    named = [m for line in rows for m in NAMED.finditer(line)]
    assert rows and named
    problems = []
    for match in named:
        rel, function, section = match.groups()
        path = ROOT / rel
        if not path.is_file():
            problems.append(f"{rel}: no such file")
            continue
        strings, functions = _strings_and_functions(path)
        if function not in functions:
            problems.append(f"{rel}: no function {function}")
        if section is not None:
            program = path.with_name(path.name.removeprefix("test_").replace("_conformance", "_program"))
            defined = _strings_and_functions(program)[1] if program.is_file() else set()
            if section not in strings or section not in defined:
                problems.append(
                    f"{rel}::{function}[{section}]: not a section of {program.name} the test runs"
                )
    assert not problems, "\n".join(problems)


def test_every_row_is_mapped_or_explained() -> None:
    """A row names a counterpart, or says why there is none ("n/a: ..." or "no counterpart: ...")."""
    for line in (HERE / "COVERAGE.md").read_text().splitlines():
        if line.startswith("| `test_"):
            answer = line.split("|")[2].strip()
            assert NAMED.search(answer) or answer.startswith(("n/a:", "no counterpart:")), line
