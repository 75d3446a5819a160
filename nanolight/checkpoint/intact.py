"""Which checkpoint is whole: asked when one turns out damaged, so the error can name the newest
intact one to resume from instead (and by nothing on the hot path: it opens every file)."""

from __future__ import annotations

import re
from pathlib import Path

from nanolight.checkpoint.files import CheckpointError
from nanolight.checkpoint.reader import CheckpointReader

_STEP = re.compile(r"(?:^|[-_])step[-=](\d+)")  # step-12, epoch=0-step=12, ...-step=12-...


def is_intact(path: str | Path) -> bool:
    """Every file of checkpoint `path` is there, as large as written and with its checksum (a
    checkpoint from before checksums: every file opens)."""
    try:
        CheckpointReader.open(path).verify_all()
    except (CheckpointError, OSError, ValueError):
        return False
    return True


def newest_intact(parent: Path, exclude: Path | None = None) -> Path | None:
    """The newest checkpoint under `parent` (other than `exclude`) that `is_intact`, by the step in
    its name: the recipe's ``step-<N>``, Lightning's ``epoch=<E>-step=<N>`` or a template's."""
    steps = {p: int(m[-1]) for p in Path(parent).iterdir() if p.is_dir() and (m := _STEP.findall(p.name))}
    for step in sorted(steps, key=lambda p: steps[p], reverse=True):
        if (exclude is None or step.resolve() != Path(exclude).resolve()) and is_intact(step):
            return step
    return None
