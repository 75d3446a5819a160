"""Six ordinary Lightning 2.6 programs, ported by the renames alone, behave as Lightning itself
did: the same logged keys at the same steps with the same values (exactly: the programs are fp32
and both runs take the kernel path `lightning_compare.PINNED_KERNELS` fixes), the same
callback/logged metrics, the same best checkpoint, the same hook order and the same final weights.

The reference is `tests/fixtures/lightning/*.json`, recorded from real Lightning
(`tests/lightning_programs/record.py`; Lightning is not a dependency). The one deliberate
difference tolerated: nanolight keeps a ``last`` pointer next to its checkpoint directories."""

from __future__ import annotations

import pytest
from lightning_compare import PROGRAMS, differences, fixture, port, run_ported

PROGRAM_NAMES = [
    "classifier",
    "regression_resume",
    "gan_manual",
    "flags_plateau",
    "hook_order",
    "trainer_args",
]


def _without_last_pointer(observed: object, want: object) -> None:
    """Drop nanolight's ``last`` pointer from listed checkpoint files where Lightning has none."""
    if isinstance(observed, dict) and isinstance(want, dict):
        if "files" in observed and "files" in want and "last" not in want["files"]:
            observed["files"] = [f for f in observed["files"] if f != "last"]
        for key in observed.keys() & want.keys():
            _without_last_pointer(observed[key], want[key])
    elif isinstance(observed, list) and isinstance(want, list):
        for o, w in zip(observed, want, strict=False):
            _without_last_pointer(o, w)


def test_port_is_only_renames() -> None:
    source = (PROGRAMS / "classifier.py").read_text()
    ported = port(source)
    assert "import nanolight as L" in ported and "L.NanoModule" in ported and "L.NanoDataModule" in ported
    assert "lightning.pytorch" not in ported and "import lightning" not in ported
    # nothing but the renamed names changed
    assert (
        ported.replace("nanolight", "lightning")
        .replace("Nano", "Lightning")
        .replace("L.LightningTrainer", "L.Trainer")
        .replace("lightning.callbacks", "lightning.pytorch.callbacks")
        .replace("lightning.loggers", "lightning.pytorch.loggers")
        == source
    )


@pytest.mark.parametrize("program", PROGRAM_NAMES)
def test_ported_program_behaves_like_lightning(program: str, tmp_path) -> None:
    want = fixture(program)
    want.pop("versions")
    got = run_ported(program, tmp_path)
    _without_last_pointer(got, want)
    diffs = differences(want, got, rel=0.0, abs_=0.0)
    assert not diffs, f"{len(diffs)} differences from Lightning, first: " + "\n".join(diffs[:25])
