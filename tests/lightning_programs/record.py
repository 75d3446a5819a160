"""Record what real Lightning does with the five programs, as JSON fixtures for nanolight's tests.

Re-run (Lightning lives in its own virtualenv, never in nanolight's dependencies)::

    python -m venv /work/venv-lit     # with torch 2.13.0 (or a .pth to the project's site-packages)
    /work/venv-lit/bin/pip install --no-deps "lightning==2.6.6" torchmetrics
    /work/venv-lit/bin/python tests/lightning_programs/record.py [PROGRAM ...]

Recorded with lightning 2.6.6 and torch 2.13.0+cpu (CPU, fp32, the kernels pinned by
``lightning_compare.PINNED_KERNELS`` as in the test run); both versions are also stored in
each fixture under ``"versions"``. Each program runs twice in fresh temporary directories and the
two ``observed.json`` must be identical (the programs are deterministic: fixed seeds, private data
generators, no timings or absolute paths in the output); the fixture is then written to
``tests/fixtures/lightning/<program>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from lightning_compare import (  # noqa: E402  (the same kernel path as the test run)
    CONFORMANCE_NAMES,
    PINNED_KERNELS,
    PROGRAM_NAMES,
    program_dir,
)

FIXTURES = HERE.parent / "fixtures" / "lightning"


def run_once(program: str) -> dict[str, Any]:
    """Run one program in a fresh directory and return its observed.json."""
    with tempfile.TemporaryDirectory(prefix=f"lightning-{program}-") as tmp:
        proc = subprocess.run(
            [sys.executable, str(program_dir(program) / f"{program}.py"), tmp],
            cwd=tmp,
            capture_output=True,
            text=True,
            env={**os.environ, **PINNED_KERNELS, "PYTHONPATH": str(HERE)},  # observe.py
        )
        if proc.returncode != 0:
            raise SystemExit(f"{program} failed:\n{proc.stdout}\n{proc.stderr}")
        return json.loads((Path(tmp) / "observed.json").read_text())


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two JSON values differ (to name a non-deterministic field)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only in one run" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")
        ]
    return [] if a == b else [path or "/"]


def main() -> None:
    import lightning
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = PROGRAM_NAMES + CONFORMANCE_NAMES
    parser.add_argument("programs", nargs="*", help=f"some of {names} (default: all)")
    args = parser.parse_args()
    unknown = set(args.programs) - set(names)
    if unknown:
        parser.error(f"unknown programs {sorted(unknown)}; choose from {names}")
    versions = {"lightning": lightning.__version__, "torch": torch.__version__}
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for program in args.programs or names:
        first, second = run_once(program), run_once(program)
        diff = differences(first, second)
        if diff:
            raise SystemExit(f"{program} is not deterministic; differing fields: {diff[:20]}")
        out = FIXTURES / f"{program}.json"
        out.write_text(json.dumps({"versions": versions, **first}, indent=1) + "\n")
        print(f"{program}: identical over two runs -> {out.relative_to(HERE.parent.parent)}")


if __name__ == "__main__":
    main()
