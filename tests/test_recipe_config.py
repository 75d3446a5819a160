"""The recipe's config contract: every preset composes and validates; bad keys fail by name."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _dist import IMPORT_REPORT, NOT_IMPORTED_BY_A_RUN, imported, pythonpath, without_import_report
from hydra import compose, initialize_config_dir

from nanolight.pretrain import ConfigError, PretrainConfig, load_config

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def _presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("model", _presets("model"))
@pytest.mark.parametrize("data", _presets("data"))
@pytest.mark.parametrize("logger", _presets("logger"))
def test_every_preset_composes_and_validates(model: str, data: str, logger: str) -> None:
    config = load_config(_compose([f"model={model}", f"data={data}", f"logger={logger}"]))
    assert isinstance(config, PretrainConfig)
    assert config.model.num_hidden_layers >= 1 and config.data.path


def test_parallel_keys_append_with_plus() -> None:
    config = load_config(_compose(["+parallel.tp=2", "+parallel.sequence_parallel=true"]))
    assert (config.parallel.tp, config.parallel.sequence_parallel) == (2, True)
    assert load_config(_compose([])).parallel.tp == 1


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        (["+trainer.max_step=5"], "Did you mean `trainer.max_steps`?"),
        (["+optim.learning_rate=1"], "Valid keys of `optim`"),
        (["+parallel.tpp=2"], "unknown config key `parallel.tpp`"),
        (["trainer.micro_batch_size=abc"], "must be an integer"),
        (["trainer.precision=fp8"], "not one of"),
        (["trainer.seq_len=4096"], "above the model's maximum"),
        (["+parallel.tp=0"], "positive integer"),
        (["optim.lr=-1"], "optim.lr must be a finite number > 0"),
        (["data.val_fraction=1.5"], "data.val_fraction"),
        (["model.num_attention_heads=5"], "model"),
    ],
)
def test_bad_values_name_the_key(override: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        load_config(_compose(override))
    assert fragment in str(info.value), str(info.value)


def test_bad_config_exits_fast_and_writes_nothing(tmp_path: Path) -> None:
    """A misspelled key in an existing run directory: exit 2 in seconds, the directory untouched."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-5").mkdir(parents=True)
    (run_dir / "metrics.csv").write_text("step,train/loss\n5,1.0\n")
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    start = time.monotonic()
    for override in ("trainer.max_step=3", "checkpoint.resume=null"):
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO / "recipes" / "smollm.py"),
                override,
                f"trainer.default_root_dir={run_dir}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": pythonpath(REPO)},
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.startswith("nanolight: error: ") and "Traceback" not in proc.stderr
    assert time.monotonic() - start < 60
    assert "already holds checkpoints" in proc.stderr and "checkpoint.resume=last" in proc.stderr
    after = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    assert after == before
    assert not (tmp_path / "outputs").exists()  # Hydra writes nothing of its own


def test_a_bad_config_imports_only_what_a_run_uses(tmp_path: Path) -> None:
    """The recipe's module-level imports are what every training process (each rank too) pays
    before it can even say a key is wrong: not the dry run's tools (torch's trackers, with dynamo,
    inductor and DTensor), nor hub datasets, nor the tokenizer's library (imported where a tokenizer
    loads), nor wandb (where a wandb logger starts)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "smollm.py"), "trainer.seq_len=-1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, **IMPORT_REPORT, "PYTHONPATH": pythonpath(REPO)},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = without_import_report(proc.stderr).strip().splitlines()
    assert lines == ["nanolight: error: invalid `trainer` config: trainer.seq_len must be >= 1, got -1"]
    assert "nanolight.pretrain.run" in imported(proc.stderr, "nanolight")  # the report is read
    assert imported(proc.stderr, *NOT_IMPORTED_BY_A_RUN, "transformers") == []


def test_override_keys_checked_before_hydra() -> None:
    from nanolight.pretrain.schema import check_override_keys

    groups = ("model", "data", "logger")
    check_override_keys(PretrainConfig, ["model=smollm-135m", "+parallel.tp=2", "hydra.run.dir=x"], groups)
    check_override_keys(PretrainConfig, ["model.rope_scaling.factor=8", "--cfg", "job"], groups)
    with pytest.raises(
        ConfigError, match=r"unknown config key `trainer.max_step`. Did you mean `trainer.max_steps`"
    ):
        check_override_keys(PretrainConfig, ["trainer.max_step=3"], groups)
    with pytest.raises(
        ConfigError, match=r"Valid keys of the config: checkpoint, cluster, data, dry_run, logger"
    ):
        check_override_keys(PretrainConfig, ["sed=3"], groups)


def test_tp_must_divide_heads_before_spawn() -> None:
    from nanolight.pretrain.run import check_layout

    config = load_config(_compose(["+parallel.tp=3"]))
    with pytest.raises(ConfigError, match=r"tp=3 does not divide num_attention_heads=4"):
        check_layout(config)


def test_torchrun_world_without_layout_is_not_single_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """`torchrun --nproc_per_node=2 recipes/smollm.py` must not train two independent copies."""
    from nanolight.pretrain.run import build_strategy
    from nanolight.strategies import Parallel3DStrategy, SingleDeviceStrategy

    config = load_config(_compose([]))
    assert isinstance(build_strategy(config), SingleDeviceStrategy)
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(name, value)
    assert isinstance(build_strategy(config), Parallel3DStrategy)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert isinstance(build_strategy(config), SingleDeviceStrategy)


def _prepared_lookalike(tmp_path: Path) -> str:
    """A directory made by scripts/prepare_data.py, as far as its index says."""
    data = tmp_path / "prepared"
    data.mkdir()
    (data / "index.json").write_text('{"format": "nanolight-tokens", "version": 1, "shards": []}')
    return str(data)


def _hf_export(tmp_path: Path) -> str:
    """What scripts/convert_nanolight_to_hf.py writes, as far as its config.json says."""
    export = tmp_path / "hf-export"
    export.mkdir()
    (export / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    return str(export)


# Every bad input tried, one line each: (script, arguments, what the line says). Each exits nonzero
# in seconds with one `nanolight: error: ...` line and no traceback (`--debug` shows it).
BAD_INPUTS = [
    ("smollm.py", ["optim.lr=nan"], "optim.lr must be a finite number > 0"),
    ("smollm.py", ["data.mixture=[{path:/d/web,weight:inf}]"], "weight=inf must be a finite number > 0"),
    ("smollm.py", ["trainer.seq_len=abc"], "`trainer.seq_len` = 'abc' must be an integer"),
    ("smollm.py", ["trainer.seq_len=["], "cannot parse the override 'trainer.seq_len=['"),
    ("smollm.py", ["+parallel=foo"], "write +parallel=auto (the planner picks one) or set its keys"),
    ("smollm.py", ["checkpoint.resume={prepared}"], "prepared is not a checkpoint directory"),
    ("smollm.py", ["checkpoint.init_from={hf_export}"], "convert_hf_to_nanolight.py"),
    ("plan.py", ["+plan.global_batch_tokens=0"], "+plan.global_batch_tokens=0 must be a positive integer"),
    ("plan.py", ["+plan.global_batch_tokens=-8"], "+plan.global_batch_tokens=-8 must be a positive integer"),
    ("plan.py", ["+plan.global_batch_tokens=8", "trainer.seq_len=abc"], "trainer.seq_len='abc' must be a"),
    ("plan.py", ["+plan.global_batch_tokens=8", "model=["], "cannot parse the override 'model=['"),
]
PLAN_CLUSTER = ["+cluster.gpus=2", "+cluster.gpu=h100-sxm"]


@pytest.mark.parametrize(
    ("script", "args", "fragment"), BAD_INPUTS, ids=[" ".join(a) for _, a, _ in BAD_INPUTS]
)
def test_each_bad_input_is_one_line(tmp_path: Path, script: str, args: list[str], fragment: str) -> None:
    if any("{" in a and "{path" not in a for a in args):
        made = {"prepared": _prepared_lookalike(tmp_path), "hf_export": _hf_export(tmp_path)}
        args = [a.format(**made) for a in args]
    if script == "plan.py":
        path, args = REPO / "scripts" / "plan.py", PLAN_CLUSTER + args
    else:
        path, args = REPO / "recipes" / script, [*args, f"trainer.default_root_dir={tmp_path / 'run'}"]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": pythonpath(REPO)},
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("nanolight: error: ") and fragment in lines[-1], proc.stderr[-3000:]
    assert [line for line in lines if "error" in line.lower()] == lines[-1:], proc.stderr[-3000:]
    assert time.monotonic() - start < 60  # seconds on an idle machine; generous for a loaded one
