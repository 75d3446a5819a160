"""What the repository itself promises a newcomer: the README's commands leave `git status` clean,
and CI stops at the step that fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _written_by_readme() -> set[str]:
    """Top-level directories the README's commands write: export targets, the run directory,
    and what Hydra or wandb would drop beside them."""
    readme = (REPO / "README.md").read_text()
    tops = {p.split("/")[0] for p in re.findall(r"--save-path (\S+)", readme)}
    root = re.search(r"default_root_dir: (\S+)", (REPO / "conf" / "config.yaml").read_text())
    assert root is not None
    return tops | {root.group(1).split("/")[0], "outputs", "wandb"}


@pytest.mark.skipif(not (REPO / ".git").exists() or shutil.which("git") is None, reason="not a git checkout")
def test_readme_outputs_are_ignored() -> None:
    paths = sorted(f"{top}/x" for top in _written_by_readme())
    assert {"hf/x", "runs/x", "ckpt/x"} <= set(paths)
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths], cwd=REPO, capture_output=True, text=True
    )
    ignored = set(done.stdout.split())
    assert ignored == set(paths), f"not in .gitignore: {sorted(set(paths) - ignored)}"


def test_ci_stops_when_install_fails(tmp_path: Path) -> None:
    """Under ``set -e`` a failing command left of ``&&`` does not stop a script: the install must
    be its own line."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "install.sh").write_text("exit 1\n")
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    fake = bin_dir / "python3"  # records every call; `-m venv DIR` makes an activatable DIR
    fake.write_text(
        '#!/usr/bin/env bash\necho "$*" >> "$LOG"\n'
        'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; echo "PATH=$PATH" > "$3/bin/activate"; fi\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log)}
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "pytest" not in log.read_text(), log.read_text()
