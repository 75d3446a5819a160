"""The map kept true: each invariant ARCHITECTURE.md states is a test over the source (``ast`` and
text, nothing imported; the checks are in ``_architecture.py``).

Every check runs twice: on ``nanolight/`` itself, and on a small tree written here, clean and then
with one violation injected -- so each test is seen to fail when its invariant breaks.
"""

from __future__ import annotations

from pathlib import Path

import _architecture as arch
import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "nanolight"
TARGETS = arch.SizeTargets()


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """A package ``nanolight/`` under `root` holding `files` (``__init__.py`` files added)."""
    pkg = root / "nanolight"
    for rel, text in {"__init__.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(pkg).parents:
            (pkg / parent / "__init__.py").touch()
        path.write_text(text)
    return pkg


def report(violations: list[str]) -> str:
    return "\n".join(violations)


# 1. Imports point down ---------------------------------------------------------------------------

LAYERED = {
    "models/llama.py": "from nanolight.errors import UsageError\n",
    "parallel/shard.py": "from nanolight.models import llama\n",
    "checkpoint/load.py": "from nanolight.errors import UsageError\n",
    "models/pretrained.py": "from nanolight.checkpoint import load\n",
    "callbacks/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nanolight.trainer import NanoTrainer\n",
    "trainer/trainer.py": "from nanolight.callbacks.base import Callback\n",
    "errors.py": "",
}


def test_imports_point_down() -> None:
    violations = arch.upward_imports(PKG)
    assert not violations, report(violations)


@pytest.mark.parametrize(
    ("rel", "code", "expected"),
    [
        (
            "models/llama.py",
            "from nanolight.parallel.shard import x\n",
            "models imports parallel.shard (higher",
        ),
        (
            "checkpoint/load.py",
            "def f():\n    from nanolight.models import llama\n",
            "checkpoint imports models.llama (higher",
        ),
        (
            "checkpoint/load.py",
            "from nanolight.parallel import shard\n",
            "checkpoint imports parallel.shard (higher",
        ),
        (
            "parallel/shard.py",
            "from ..trainer.trainer import NanoTrainer\n",
            "parallel imports trainer.trainer (higher",
        ),
        (
            "parallel/shard.py",
            "if TYPE_CHECKING:\n    from nanolight.trainer import T\n",
            "parallel imports trainer",
        ),
        ("checkpoint/load.py", "from .. import parallel\n", "checkpoint imports parallel (higher"),
        ("models/llama.py", "import scripts.plan\n", "imports scripts.plan (the library imports no program)"),
        ("newpkg/x.py", "", "package 'newpkg' has no place in LAYERS"),
    ],
)
def test_imports_point_down_fails_when_broken(tmp_path: Path, rel: str, code: str, expected: str) -> None:
    assert arch.upward_imports(write_tree(tmp_path / "clean", LAYERED)) == []
    broken = write_tree(tmp_path / "broken", {**LAYERED, rel: LAYERED.get(rel, "") + code})
    assert any(expected in v for v in arch.upward_imports(broken)), arch.upward_imports(broken)


def test_no_import_cycles() -> None:
    violations = arch.import_cycles(PKG)
    assert not violations, report(violations)


def test_no_import_cycles_fails_when_broken(tmp_path: Path) -> None:
    clean = {
        "trainer/a.py": "from nanolight.trainer import b\n",
        "trainer/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nanolight.trainer.a import A\n",
    }
    assert arch.import_cycles(write_tree(tmp_path / "clean", clean)) == []
    deferred = {**clean, "trainer/b.py": "def f():\n    from nanolight.trainer.a import A\n"}
    cycles = arch.import_cycles(write_tree(tmp_path / "broken", deferred))
    assert cycles == ["a cycle among trainer.a, trainer.b"]
    ring = {f"data/{a}.py": f"from nanolight.data import {b}\n" for a, b in ("xa", "ab", "bc", "ca")}
    cycles = arch.import_cycles(write_tree(tmp_path / "ring", ring))  # x leads into the ring, not in it
    assert cycles == ["a cycle among data.a, data.b, data.c"]


# 2. Only the launcher reads the launch environment -----------------------------------------------


def test_only_the_launcher_reads_launch_variables() -> None:
    violations = arch.launch_env_reads(PKG)
    assert not violations, report(violations)


@pytest.mark.parametrize(
    "code",
    [
        'import os\nrank = int(os.environ.get("RANK", 0))\n',
        'import os\nrank = os.environ["LOCAL_RANK"]\n',
        'import os\nrank = os.getenv("SLURM_PROCID")\n',
        'import os\nenv = dict(os.environ)\nwrapped = "TORCHELASTIC_RUN_ID" in env\n',
    ],
)
def test_only_the_launcher_reads_launch_variables_fails_when_broken(tmp_path: Path, code: str) -> None:
    allowed = {rel: code for rel in arch.LAUNCH_MODULES}
    clean = {**allowed, "seed.py": 'import os\nseed = os.environ.get("PL_GLOBAL_SEED")\n'}
    assert arch.launch_env_reads(write_tree(tmp_path / "clean", clean)) == []
    broken = write_tree(tmp_path / "broken", {**clean, "trainer/data.py": code})
    assert [v.split(":")[0] for v in arch.launch_env_reads(broken)] == ["trainer/data.py"]


def test_only_parallel_context_creates_process_groups() -> None:
    violations = arch.process_groups_outside_context(PKG)
    assert not violations, report(violations)


@pytest.mark.parametrize(
    "code",
    [
        "import torch.distributed as dist\ngroup = dist.new_group(ranks=[0, 1])\n",
        "from torch.distributed import init_process_group\ninit_process_group('gloo')\n",
        "from torch.distributed.device_mesh import init_device_mesh\nmesh = init_device_mesh('cpu', (2,))\n",
    ],
)
def test_process_groups_fail_when_broken(tmp_path: Path, code: str) -> None:
    clean = {
        "parallel/context.py": "import torch.distributed as dist\ngroup = dist.new_group(ranks=[0, 1])\n",
        "parallel/launcher.py": "import torch.distributed as dist\ndist.init_process_group('gloo')\n",
        "strategies/base.py": "import torch.distributed as dist\ndist.all_reduce(x, group=context.group('dp'))\n",
    }
    assert arch.process_groups_outside_context(write_tree(tmp_path / "clean", clean)) == []
    broken = write_tree(tmp_path / "broken", {**clean, "strategies/base.py": code})
    assert [v.split(":")[0] for v in arch.process_groups_outside_context(broken)] == ["strategies/base.py"]


# 3. Every atomic write goes through checkpoint/atomic.py -----------------------------------------


def test_atomic_writes_go_through_atomic_py() -> None:
    violations = arch.renames_outside_atomic(PKG)
    assert not violations, report(violations)


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.replace(tmp, path)\n",
        "import os\nos.rename(tmp, path)\n",
        "import shutil\nshutil.move(tmp, path)\n",
        "from os import replace as swap\nswap(tmp, path)\n",
        "tmp.with_suffix('.tmp').rename(path)\n",
        "Path(tmp).replace(path)\n",
    ],
)
def test_atomic_writes_fail_when_broken(tmp_path: Path, code: str) -> None:
    harmless = 'import dataclasses\nname = "a-b".replace("-", "_")\ncfg = dataclasses.replace(cfg, x=1)\n'
    clean = {arch.ATOMIC_MODULE: "import os\nos.replace(tmp, path)\n", "data/cache.py": harmless}
    assert arch.renames_outside_atomic(write_tree(tmp_path / "clean", clean)) == []
    broken = write_tree(tmp_path / "broken", {**clean, "data/cache.py": harmless + code})
    assert [v.split(":")[0] for v in arch.renames_outside_atomic(broken)] == ["data/cache.py"]


# 4. No module touches another's private state ----------------------------------------------------


def test_no_module_touches_another_modules_private_state() -> None:
    violations = arch.private_access(PKG)
    assert not violations, report(violations)


PRIVATE_OWNER = """
_CACHE = {}

def _helper():
    pass

class ModelCheckpoint:
    def __init__(self):
        self._last_saved = ""

    def __eq__(self, other):
        return self._last_saved == other._last_saved  # its own class's private: fine
"""


@pytest.mark.parametrize(
    "code",
    [
        "def f(cb):\n    return cb._last_saved\n",
        "def f(cb):\n    cb._last_saved = 'x'\n",
        "def f(cb):\n    return getattr(cb, '_last_saved', None)\n",
        "from nanolight.callbacks.model_checkpoint import _helper\n",
        "from nanolight.callbacks import model_checkpoint as mc\nx = mc._CACHE\n",
    ],
)
def test_private_state_fails_when_broken(tmp_path: Path, code: str) -> None:
    user = "import torch\nclass Logger:\n    def __init__(self):\n        self._rows = []\n"
    user += (
        "    def f(self, t, cb):\n        return self._rows, t._base, torch._C, super()._hidden, cb.last\n"
    )
    clean = {"callbacks/model_checkpoint.py": PRIVATE_OWNER, "loggers/wandb.py": user}
    assert arch.private_access(write_tree(tmp_path / "clean", clean)) == []
    broken = write_tree(tmp_path / "broken", {**clean, "loggers/wandb.py": user + code})
    assert [v.split(":")[0] for v in arch.private_access(broken)] == ["loggers/wandb.py"]


# 5. The map names every file ---------------------------------------------------------------------


def test_the_map_names_every_file() -> None:
    violations = arch.unmapped_files(PKG, (REPO / "ARCHITECTURE.md").read_text())
    assert not violations, report(violations)


def test_the_map_fails_when_broken(tmp_path: Path) -> None:
    pkg = write_tree(tmp_path, {"seed.py": "", "parallel/context.py": "", "parallel/pipeline/split.py": ""})
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "plan.py").touch()
    lines = [
        "- `seed.py` - seeding",
        "- `parallel/context.py` - groups",
        "- `parallel/pipeline/split.py` - cuts",
    ]
    assert arch.unmapped_files(pkg, "\n".join([*lines, "`scripts/plan.py` is its command line"])) == []
    assert arch.unmapped_files(pkg, "\n".join(lines[1:])) == ["seed.py: not named in the map as `seed.py`"]
    stale = arch.unmapped_files(pkg, "\n".join([*lines, "- `parallel/gone.py` - moved", "`split.py`"]))
    assert [v.split(",")[0] for v in stale] == [
        "the map names `parallel/gone.py`",
        "the map names `split.py`",
    ]


def test_the_map_names_every_strategy_method() -> None:
    violations = arch.unnamed_strategy_names(PKG, (REPO / "ARCHITECTURE.md").read_text())
    assert not violations, report(violations)


def test_strategy_names_fail_when_broken(tmp_path: Path) -> None:
    code = (
        "class Strategy:\n    def barrier(self): ...\n    def _own(self): ...\n    def any_rank(self): ...\n"
    )
    pkg = write_tree(tmp_path, {"strategies/base.py": code})
    assert arch.unnamed_strategy_names(pkg, "`barrier`, `Strategy.any_rank`") == []
    assert arch.unnamed_strategy_names(pkg, "`barrier`, any_rank") == [
        "strategies/base.py: Strategy.any_rank is not named in the map"
    ]


# 5b. No parallel code in the trainer --------------------------------------------------------------


def test_trainer_holds_no_parallel_code() -> None:
    violations = arch.parallel_code_in_trainer(PKG)
    assert not violations, report(violations)


@pytest.mark.parametrize(
    "code",
    [
        "from nanolight.parallel.grads import GradientSync\n",
        "def f():\n    from nanolight.parallel import grads\n",
        "import torch.distributed as dist\n",
        "from torch.distributed import all_reduce\n",
    ],
)
def test_parallel_code_in_the_trainer_fails_when_broken(tmp_path: Path, code: str) -> None:
    core = {"parallel/environment.py": "", "parallel/grads.py": ""}
    allowed = "from nanolight.parallel.environment import detect_environment\n"
    clean = write_tree(tmp_path / "clean", {**core, "trainer/arguments.py": allowed})
    assert arch.parallel_code_in_trainer(clean) == []
    broken = write_tree(
        tmp_path / "broken", {**core, "trainer/arguments.py": allowed, "trainer/step.py": code}
    )
    assert [v.split(":")[0] for v in arch.parallel_code_in_trainer(broken)] == ["trainer/step.py"]


# 6. Every collective says who exchanges what ------------------------------------------------------

COMMENTED = (
    "import torch.distributed as dist\n"
    "def f(x, g):\n"
    "    # the tp ranks of g add their partial x\n"
    "    op = dist.ReduceOp.SUM\n"
    "    dist.all_reduce(x, op=op, group=g)\n"
    "    dist.barrier()  # every rank waits for the others\n"
    "    return dist.get_rank(g)\n"
)


def test_every_collective_has_a_comment() -> None:
    violations = arch.collectives_without_comment(PKG)
    assert not violations, report(violations)


@pytest.mark.parametrize(
    "code",
    [
        "import torch.distributed as dist\ndef f(x, g):\n    # a comment too far up\n    a = 1\n    b = 2\n"
        "    c = 3\n    dist.all_reduce(x, group=g)\n",
        "from torch.distributed import all_gather_object\ndef f(out, x):\n    all_gather_object(out, x)\n",
        "import torch\ndef f():\n    torch.distributed.barrier()\n",
        "from torch import distributed as d\ndef f(x):\n    s = '# a string, not a comment'\n    d.broadcast(x, 0)\n",
    ],
)
def test_collective_comments_fail_when_broken(tmp_path: Path, code: str) -> None:
    assert (
        arch.collectives_without_comment(write_tree(tmp_path / "clean", {"parallel/a.py": COMMENTED})) == []
    )
    broken = write_tree(tmp_path / "broken", {"parallel/a.py": COMMENTED, "parallel/b.py": code})
    assert [v.split(":")[0] for v in arch.collectives_without_comment(broken)] == ["parallel/b.py"]


# 7. The consolidation's size targets (issue 23) --------------------------------------------------


def test_few_fmt_skips() -> None:
    found = arch.fmt_skips(PKG)
    assert len(found) <= TARGETS.fmt_skips, (
        f"{len(found)} `# fmt: skip` lines in nanolight/:\n{report(found)}"
    )


def test_trainer_has_few_base_classes() -> None:
    bases = arch.trainer_bases(PKG)
    assert len(bases) <= TARGETS.trainer_bases, f"NanoTrainer has {len(bases)} base classes: {bases}"


def test_trainer_rarely_asks_whether_pipelined() -> None:
    found = arch.pipelined_in_trainer(PKG)
    assert len(found) <= TARGETS.pipelined_in_trainer, f"`.pipelined` in trainer/:\n{report(found)}"


def test_no_file_too_long() -> None:
    violations = arch.long_files(PKG, TARGETS.file_lines)
    assert not violations, report(violations)


def test_size_targets_fail_when_broken(tmp_path: Path) -> None:
    trainer = "class NanoTrainer(A, B):\n    def f(self):\n        return self.strategy.pipelined\n"
    clean = {"trainer/trainer.py": trainer, "seed.py": "x = (1,)  # fmt: skip\n" * 5}
    pkg = write_tree(tmp_path / "clean", clean)
    assert len(arch.fmt_skips(pkg)) == 5 and len(arch.trainer_bases(pkg)) == 2
    assert len(arch.pipelined_in_trainer(pkg)) == 1 and arch.long_files(pkg, TARGETS.file_lines) == []
    trainer = (
        "class NanoTrainer(A, B, C, object):\n" + "    def f(self):\n        return strategy.pipelined\n" * 3
    )
    broken = {"trainer/trainer.py": trainer + "\n" * 460, "seed.py": clean["seed.py"] + "y = 2  # fmt:skip\n"}
    pkg = write_tree(tmp_path / "broken", broken)
    assert len(arch.fmt_skips(pkg)) == 6 and arch.trainer_bases(pkg) == ["A", "B", "C"]
    assert len(arch.pipelined_in_trainer(pkg)) == 3
    assert [v.split(":")[0] for v in arch.long_files(pkg, TARGETS.file_lines)] == ["trainer/trainer.py"]
