"""`python recipes/smollm.py +parallel=auto`: the recipe runs the planner's best layout for its world.

- The pick is `search.plan`'s first row for the recipe's workload, world and pinned knobs, and the
  config it becomes runs exactly that layout (the recipe's own keys, accepted by `check_layout`).
- End to end on this CPU (2 local ranks): the pick and its prediction are printed, the run uses it
  (config.yaml), and predicted vs measured is printed at the end.
- A model that fits in no layout: the planner's no-fit line, exit non-zero, no traceback.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from _dist import pythonpath
from test_recipe_e2e import REPO, losses, recipe

from nanolight.errors import UsageError
from nanolight.models.llama_config import LlamaConfig
from nanolight.parallel.environment import PARENT_PID_VAR
from nanolight.planner.hardware import HARDWARE, table_name
from nanolight.planner.memory import Workload
from nanolight.planner.search import plan
from nanolight.pretrain.auto import (
    AUTO_ENV,
    apply_layout,
    auto_layout,
    choose_layout,
    encode_prediction,
    launched_world,
    pinned_knobs,
)
from nanolight.pretrain.config import PretrainConfig, load_config
from nanolight.pretrain.run import check_layout
from nanolight.pretrain.schema import ConfigError


def _auto_config(model: str, **trainer: int) -> PretrainConfig:
    raw = {"parallel": "auto", "model": dataclasses.asdict(LlamaConfig.preset(model)), "trainer": trainer}
    config = load_config(raw)
    assert config.auto_parallel and config.parallel.tp == 1
    return config


@pytest.mark.parametrize(
    ("model", "gpus", "gpu", "argv"),
    [
        ("smollm-1.7b", 8, "h100-sxm", []),
        ("smollm-360m", 4, "a100-40gb", ["trainer.micro_batch_size=2", "trainer.precision=auto"]),
        ("smollm-tiny", 2, "h200", ["trainer.activation_checkpointing=full"]),
    ],
)
def test_pick_is_the_planners_best(model: str, gpus: int, gpu: str, argv: list[str]) -> None:
    config = _auto_config(model, seq_len=2048 if model != "smollm-tiny" else 256, micro_batch_size=2,
                          accumulate_grad_batches=16)  # fmt: skip
    pinned = pinned_knobs(config, argv)
    assert "precision" not in pinned  # precision=auto is the planner's to choose
    hw = HARDWARE[gpu]
    t = config.trainer
    rows = plan(Workload(config.model, t.seq_len, hw.device), gpus, 32 * t.seq_len, hw, pinned)
    best = choose_layout(config, gpus, hw, pinned)
    assert best == rows[0] and best.fits
    for field, value in pinned.items():
        assert getattr(best.layout, field) == value
    # the config the recipe then runs is exactly that layout, in its own keys, and the trainer accepts it
    run_config = apply_layout(config, best.layout)
    lay, p, tr = best.layout, run_config.parallel, run_config.trainer
    assert (p.tp, p.pp, p.dp, p.zero_stage, p.pp_schedule, p.pp_virtual, p.sequence_parallel) == (
        lay.tp, lay.pp, lay.dp, lay.zero_stage, lay.pp_schedule, lay.pp_virtual, lay.sequence_parallel,
    )  # fmt: skip
    assert (tr.micro_batch_size, tr.accumulate_grad_batches, tr.precision, tr.activation_checkpointing) == (
        lay.micro_batch_size, lay.accumulate_grad_batches, lay.precision, lay.activation_checkpointing,
    )  # fmt: skip
    assert tr.micro_batch_size * tr.accumulate_grad_batches * p.dp == 32  # the user's global batch
    assert p.tp * p.pp * p.dp == gpus
    check_layout(run_config)


def test_world_and_handoff(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """torchrun's world wins (a different +cluster.gpus is an error); a rank our launcher started takes
    the launching process's pick from the environment instead of planning (and measuring) again."""
    with pytest.raises(
        ConfigError, match=r"\+cluster\.\* is read by \+parallel=auto and \+dry_run=true only"
    ):
        load_config({"cluster": {"gpus": 2}})
    config = load_config({"parallel": "auto", "cluster": {"gpus": 4, "gpu": "h100-sxm"}})
    monkeypatch.delenv(PARENT_PID_VAR, raising=False)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    assert launched_world(config) == 4  # plain python: +cluster.gpus local processes
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match=r"\+cluster.gpus=4 but torchrun started 2 processes"):
        launched_world(config)
    config.cluster.gpus = None
    assert launched_world(config) == 2
    if not torch.cuda.is_available():  # each rank would measure the CPU: they could pick differently
        with pytest.raises(
            UsageError, match=r"on CPU plans in one process: start plain python with \+cluster"
        ):
            auto_layout(config, [])
    # the launching process's pick, handed to a rank it started: used as is, nothing printed
    config.cluster.gpus = 8
    chosen = choose_layout(config, 8, HARDWARE["h100-sxm"], {})
    monkeypatch.setenv(AUTO_ENV, encode_prediction(chosen))
    monkeypatch.setenv(PARENT_PID_VAR, "1")
    run_config, got = auto_layout(config, [])
    assert got == chosen and run_config.parallel.dp == chosen.layout.dp and run_config.auto_parallel
    assert capsys.readouterr().out == ""


def test_accumulation_sizes_the_global_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under auto, micro_batch_size given is pinned; accumulate_grad_batches given sizes the global
    batch (micro-batch x accumulation sequences) that the pick may split over dp."""
    hw = HARDWARE["h100-sxm"]
    monkeypatch.setattr("nanolight.pretrain.auto.local_hardware", lambda config: hw)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(AUTO_ENV, "")  # recorded, so the pick auto_layout exports is undone afterwards
    raw = {
        "parallel": "auto",
        "cluster": {"gpus": 4},
        "trainer": {"micro_batch_size": 2, "accumulate_grad_batches": 8},
    }
    config = load_config(raw)
    argv = [
        "+parallel=auto",
        "+cluster.gpus=4",
        "trainer.micro_batch_size=2",
        "trainer.accumulate_grad_batches=8",
    ]
    run_config, best = auto_layout(config, argv)
    assert best == choose_layout(config, 4, hw, {"micro_batch_size": 2})
    assert best.layout.dp > 1 and best.layout.micro_batch_size == 2 and best.layout.sequences_per_step == 16
    assert run_config.trainer.accumulate_grad_batches == 16 // (2 * best.layout.dp)


def test_cuda_device_names_map_to_the_table() -> None:
    names = {
        "NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H200": "h200",
        "NVIDIA H100 NVL": "h100-nvl", "NVIDIA H200 NVL": "h200-nvl", "NVIDIA GH200 480GB": "h200",
        "NVIDIA A100-SXM4-40GB": "a100-40gb", "NVIDIA A100-SXM4-80GB": "a100-80gb", "NVIDIA B200": "b200",
        "NVIDIA L40S": "l40s", "NVIDIA L4": "l4", "NVIDIA L40": None, "NVIDIA A10": "a10",
        "NVIDIA A100 80GB PCIe": "a100-80gb", "NVIDIA GeForce RTX 4090": "rtx-4090",
        "Tesla V100-SXM2-16GB": None,
    }  # fmt: skip
    assert {name: table_name(name) for name in names} == names


def test_the_visible_gpu_is_measured_where_one_process_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """The visible GPU's table entry gets the host's cost per block measured on it (`at_hand`) when
    one process plans for the world; under torchrun every rank plans, from the table alone (a
    measurement could differ between ranks, and they must pick alike); a GPU named for another
    machine (`+cluster.gpu`) is the table's."""
    from nanolight.pretrain import auto

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    measured = []

    def at_hand(hw: object, device: torch.device) -> object:
        measured.append((hw.name, str(device)))
        return dataclasses.replace(hw, block_overhead=1e-3)

    monkeypatch.setattr(auto, "at_hand", at_hand)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", PARENT_PID_VAR):
        monkeypatch.delenv(var, raising=False)
    config = load_config({"parallel": "auto"})
    assert auto.local_hardware(config).block_overhead == 1e-3 and measured == [("h100-sxm", "cuda:0")]
    config.cluster.gpu = "h100-sxm"
    assert auto.local_hardware(config).block_overhead == 1e-3 and len(measured) == 2
    config.cluster.gpu = "a100-80gb"
    assert auto.local_hardware(config) == HARDWARE["a100-80gb"] and len(measured) == 2
    config.cluster.gpu = None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert auto.local_hardware(config) == HARDWARE["h100-sxm"] and len(measured) == 2


def _no_fit_layers() -> int:
    """Layers of smollm-1.7b whose fp32 weights, gradients and Adam state (16 bytes a parameter, ~67M
    parameters a layer) alone exceed this machine's memory: no layout of one process fits."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(24, 2 * total // (16 * 67_000_000) + 1)


def test_no_fit_is_one_line(tmp_path: Path) -> None:
    cmd = [
        sys.executable, str(REPO / "recipes" / "smollm.py"), "+parallel=auto", "model=smollm-1.7b",
        f"model.num_hidden_layers={_no_fit_layers()}", f"trainer.default_root_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanolight: error: no layout fits 1 x cpu"), proc.stderr
    assert "try " in lines[0] and "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was written


@pytest.mark.slow
def test_recipe_auto_runs_the_pick(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = recipe(
        run_dir, tmp_path / "cache", "+parallel=auto", "+cluster.gpus=2", "trainer.max_steps=4",
        "trainer.val_check_interval=null", "logger=csv", "checkpoint.every_n_steps=null",
    )  # fmt: skip
    out = proc.stdout.splitlines()
    pick = [line for line in out if line.startswith("nanolight: +parallel=auto on 2 x cpu: ")]
    assert len(pick) == 1, proc.stdout[-3000:]
    assert "predicted peak" in pick[0] and " per rank, step " in pick[0]
    # the BASE_OVERRIDES pin micro_batch_size=4 with a global batch of 4: dp cannot split it, tp, pp
    # (one micro-batch) or cp can; the run's config is the printed pick
    overrides = pick[0].removeprefix("nanolight: +parallel=auto on 2 x cpu: ").split(" -- ")[0]
    printed = dict(o.lstrip("+").split("=") for o in overrides.split())
    split = int(printed["parallel.tp"]) * int(printed["parallel.pp"]) * int(printed.get("parallel.cp", 1))
    assert printed["parallel.dp"] == "1" and split == 2
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["auto_parallel"] and saved["trainer"]["micro_batch_size"] == 4
    for key, value in printed.items():
        section, name = key.split(".")
        assert str(saved[section][name]).lower() == value.lower(), key
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    report = [line for line in out if line.startswith("nanolight: +parallel=auto predicted vs measured: ")]
    assert len(report) == 1, proc.stdout[-3000:]
    assert "(peak RSS growth, most loaded rank)" in report[0] and "(median of 4)" in report[0]


def test_no_pick_the_strategy_refuses() -> None:
    """bf16-master's fp32 masters live in ZeRO-1's optimizer: the strategy refuses it with plain dp > 1
    (`Precision.check_layout`), so the planner must never list, let alone pick, that layout."""
    rows = plan(Workload(LlamaConfig.preset("smollm-360m"), 2048, "cuda"), 8, 64 * 2048, HARDWARE["h100-sxm"])
    lays = [r.layout for r in rows]
    assert not [lay for lay in lays if lay.precision == "bf16-master" and lay.zero_stage == 0 and lay.dp > 1]
    assert [lay for lay in lays if lay.precision == "bf16-master" and lay.zero_stage == 1 and lay.dp > 1]


def test_a_pinned_parallel_key_is_planned_around() -> None:
    """`+parallel=auto +parallel.tp=2`: Hydra composes `parallel: {tp: 2}` (the `auto` replaced);
    the command line still asks for the planner, with tp pinned -- not a silent tp=2 run, unplanned."""
    from hydra import compose, initialize_config_dir

    argv = [
        "+parallel=auto",
        "+parallel.tp=2",
        "+cluster.gpus=8",
        "+cluster.gpu=h100-sxm",
        "trainer.seq_len=256",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        config = load_config(compose(config_name="config", overrides=argv), argv)
    assert config.auto_parallel
    pinned = pinned_knobs(config, argv)
    assert pinned == {"tp": 2}
    best = choose_layout(config, 8, HARDWARE["h100-sxm"], pinned)
    assert best.layout.tp == 2 and best.layout.tp * best.layout.pp * best.layout.cp * best.layout.dp == 8
