"""COVERAGE.md names real tests: every ``path::name[section]`` it lists is a test function of that
file (and ``section`` one the file runs), and every row names a test or says why there is none."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = Path(__file__).with_name("COVERAGE.md")
NODE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[(\w+)\])?`")
REASONS = ("n/a:", "not covered", "no counterpart:")


def test_every_named_test_exists() -> None:
    missing = []
    for path, name, param in NODE.findall(TABLE.read_text()):
        source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
        if f"def {name}(" not in source or (param and f'"{param}"' not in source):
            missing.append(f"{path}::{name}[{param}]" if param else f"{path}::{name}")
    assert not missing, f"COVERAGE.md names tests that do not exist: {missing}"


def test_rows_have_a_test_or_a_reason() -> None:
    rows = [line for line in TABLE.read_text().splitlines() if line.startswith("| `test_")]
    bare = [r for r in rows if not NODE.search(r) and not any(reason in r for reason in REASONS)]
    assert rows and not bare, f"rows without a test or a reason: {bare}"
