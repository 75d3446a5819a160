"""Run a Lightning program of tests/lightning_programs under nanolight (the renames applied as
text, nothing else) and compare what it observed with what Lightning itself did (the fixture)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from _dist import pythonpath

HERE = Path(__file__).resolve().parent
PROGRAMS, FIXTURES = HERE / "lightning_programs", HERE / "fixtures" / "lightning"
# Issue 40's conformance programs, one per Lightning test file (their sections: that file's promises)
CONFORMANCE = HERE / "lightning_conformance"
CONFORMANCE_NAMES = [
    "csv_logger_program",
    "timer_program",
    "throughput_program",
    "early_stopping_program",
    "lr_monitor_program",
    "restore_program",
    "hparams_program",
    "hparams_checkpoint_program",
    "model_checkpoint_program",
    "model_checkpoint_runs_program",
]
# The CPU kernels' code path, pinned for Lightning's recording and the ported run alike. MKL's sgemm
# and ATen's vectorised kernels pick AVX-512 / AVX2 / ... paths by CPU, whose fp32 sums differ in
# the last bits; flags_plateau's momentum steps grow that to 1e-4 by step 23 (on one Xeon,
# MKL_CBWR=AVX2 instead of the default path moves 40 values by more than 1e-4). With MKL's
# conditional-numerical-reproducibility mode, ATen's scalar kernels and one thread, x86 CPUs take
# nearly the same path: on an AMD EPYC most programs match the Xeon's recording exactly, the rest
# within 2.4e-7 (`test_lightning_fidelity.CROSS_CPU_ABS` bounds it).
PINNED_KERNELS = {
    "MKL_CBWR": "COMPATIBLE",
    "ATEN_CPU_CAPABILITY": "default",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
PROGRAM_NAMES = [  # every ported program, in the order they were added (record.py records them all)
    "classifier",
    "regression_resume",
    "gan_manual",
    "flags_plateau",
    "hook_order",
    "trainer_args",
    "boring_surface",
    "hook_recorder",
    "manual_plateau",
    "silent_diffs",
    "logging_page",
    "autoencoder_datamodule",
    "checkpointing_page",
    "state_flags",
    "checkpoint_names",
    "conformance",
    "lm_surface",
]
RENAMES = [  # the whole port (regular expressions, applied in order)
    (r"\blightning\.pytorch\b", "nanolight"),  # callbacks, loggers, demos, utilities, core, ...
    (r"\bimport lightning as L\b", "import nanolight as L"),
    (r"\bLightningDataModule\b", "NanoDataModule"),
    (r"\bLightningModule\b", "NanoModule"),
    (r"\bTrainer\b", "NanoTrainer"),
]


def port(source: str) -> str:
    for old, new in RENAMES:
        source = re.sub(old, new, source)
    return source


def program_dir(program: str) -> Path:
    """Where a program lives: tests/lightning_programs, or tests/lightning_conformance."""
    return CONFORMANCE if program in CONFORMANCE_NAMES else PROGRAMS


def run_ported(program: str, workdir: Path) -> dict[str, Any]:
    """The program, renamed, run as a script under nanolight; returns its observed.json."""
    script = workdir / f"{program}.py"
    script.write_text(port((program_dir(program) / f"{program}.py").read_text()))
    (workdir / "observe.py").write_text((PROGRAMS / "observe.py").read_text())
    out = workdir / "out"
    out.mkdir()
    env = {**os.environ, **PINNED_KERNELS, "PYTHONPATH": pythonpath(HERE.parent, workdir)}
    proc = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "observed.json").read_text())


def fixture(program: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{program}.json").read_text())


def differences(want: Any, got: Any, path: str = "", rel: float = 1e-4, abs_: float = 1e-6) -> list[str]:
    """Every place where `got` differs from `want` (floats within rel/abs tolerance)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}: missing key {k!r}" for k in want if k not in got]
        out += [f"{path}: unexpected key {k!r}" for k in got if k not in want]
        for k in want:
            if k in got:
                out += differences(want[k], got[k], f"{path}.{k}", rel, abs_)
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [
                f"{path}: length {len(got)} != {len(want)} (want {str(want)[:300]}, got {str(got)[:300]})"
            ]
        return [
            d
            for i, (w, g) in enumerate(zip(want, got, strict=True))
            for d in differences(w, g, f"{path}[{i}]", rel, abs_)
        ]
    if isinstance(want, float | int) and isinstance(got, float | int) and not isinstance(want, bool):
        if isinstance(want, int) and isinstance(got, int):
            return [] if want == got else [f"{path}: {got} != {want}"]
        ok = math.isclose(want, got, rel_tol=rel, abs_tol=abs_) or (math.isnan(want) and math.isnan(got))
        return [] if ok else [f"{path}: {got} != {want}"]
    return [] if want == got else [f"{path}: {got!r} != {want!r}"]


def assert_section_matches(program: str, observed: dict[str, Any], section: str) -> None:
    """One scenario of a multi-scenario program (`observed`: its run under nanolight) equals
    Lightning's recording of it."""
    want, got = fixture(program)[section], observed[section]
    assert "error" not in got, f"{section} raised under nanolight: {got['error']}"
    diffs = differences(want, got)
    assert not diffs, f"{section}: {len(diffs)} differences from Lightning:\n" + "\n".join(diffs[:20])


def assert_files_match(program: str, observed: dict[str, Any]) -> None:
    """Every metrics.csv (rows and header) and hparams.yaml a program wrote equals Lightning's."""
    want = fixture(program)
    diffs = [
        d
        for key in ("csv", "csv_columns", "hparams_yaml")
        for d in differences(want[key], observed[key], key)
    ]
    assert not diffs, f"{len(diffs)} differences from Lightning:\n" + "\n".join(diffs[:20])


# Issue 40's conformance programs for Lightning's hooks, LightningModule, trainer-flag, logging,
# optimization and loop tests (tests/lightning_conformance/COVERAGE.md maps each test to a section)
CONFORMANCE_NAMES += [
    "flags_program",
    "hooks_program",
    "optimization_program",
    "logging_program",
    "loops_program",
]
