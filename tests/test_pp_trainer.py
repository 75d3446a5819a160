"""Pipeline parallelism through NanoTrainer: the user's training_step runs unchanged on every
stage, metrics.csv holds the true loss, checkpoints equal the single-device format, and bad
layouts fail with a fix-it message."""

from __future__ import annotations

import csv
from pathlib import Path

import _tiny as tiny
import pytest
import torch
from _dist import run_distributed
from _tiny import full_state as single_device_view
from _tiny import tiny_config
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from nanolight import NanoTrainer
from nanolight.checkpoint import CheckpointReader
from nanolight.loggers import CSVLogger
from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.parallel.pipeline import balanced_layer_split, check_micro_batches
from nanolight.strategies.base import SingleDeviceStrategy
from nanolight.strategies.parallel3d import Parallel3DStrategy

SEED, STEPS, ACCUM, MICRO, T = 11, 6, 4, 2, 16


def _config(layers: int = 4) -> LlamaConfig:
    return tiny_config(vocab=256, layers=layers)


class TinyLM(tiny.TinyLM):
    """The two-line training_step a user writes; nothing here knows about stages."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__(_config(layers), seed=SEED)
        self.hook_calls = 0

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self.hook_calls += 1


def _loader(n: int) -> DataLoader:
    ids = torch.randint(0, 256, (n, T), generator=torch.Generator().manual_seed(3))
    return DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=MICRO)


def _fit(strategy: object, root: Path, accum: int = ACCUM) -> tuple[NanoTrainer, TinyLM]:
    trainer = NanoTrainer(
        use_distributed_sampler=False,  # each rank is given its own data
        max_steps=STEPS,
        accumulate_grad_batches=accum,
        gradient_clip_val=0.5,
        strategy=strategy,
        seed=SEED,
        default_root_dir=root,
        logger=CSVLogger(save_dir=root, name="", version=""),
        log_every_n_steps=1,
        val_check_interval=STEPS,
        limit_val_batches=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    module = TinyLM()
    trainer.fit(module, train_dataloaders=_loader(STEPS * ACCUM * MICRO), val_dataloaders=_loader(4 * MICRO))
    return trainer, module


def _metrics(root: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {"train/loss": {}, "val/loss": {}}
    with open(root / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for key in out:
                if row.get(key):
                    out[key][int(row["step"])] = float(row[key])
    return out


def _pp_worker(rank: int, world: int, root: str, schedule: str) -> int:
    root_path = Path(root)
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    strategy = Parallel3DStrategy(pp=world, pp_schedule=schedule, pp_virtual=virtual)
    trainer, module = _fit(strategy, root_path / "pp")
    trainer.save_checkpoint(root_path / "pp-ckpt", update_last=False)  # collective: gathers stages
    strategy.load_checkpoint(root_path / "single-ckpt")  # each stage keeps its own layers
    full = CheckpointReader.open(root_path / "single-ckpt").model_state()
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), full[name]), name
    return module.hook_calls


@pytest.mark.parametrize(
    "schedule", ["1f1b", "interleaved_1f1b", pytest.param("afab", marks=pytest.mark.slow)]
)
def test_trainer_pp2_matches_single_device(tmp_path: Path, schedule: str) -> None:
    """Under interleaving the last rank's training_step logs a placeholder the stage fills in
    later: metrics.csv still holds the single-device loss."""
    trainer, _ = _fit(SingleDeviceStrategy("cpu"), tmp_path / "single")
    trainer.save_checkpoint(tmp_path / "single-ckpt", update_last=False)

    hook_calls = run_distributed(_pp_worker, 2, str(tmp_path), schedule, timeout=240, pg_timeout=60)
    assert hook_calls == [STEPS * ACCUM] * 2  # hooks ran once per micro-batch on every stage

    ref, got = _metrics(tmp_path / "single"), _metrics(tmp_path / "pp")
    assert sorted(got["train/loss"]) == list(range(STEPS))  # Lightning logs step k at k - 1
    for key in ("train/loss", "val/loss"):  # the last stage's true values, logged by rank 0
        assert got[key], key
        for step, value in ref[key].items():
            assert got[key][step] == pytest.approx(value, rel=1e-5), (key, step)

    # the pp checkpoint read on one device: same keys, values, optimizer layout
    pp_state, (pp_optim,) = single_device_view(tmp_path / "pp-ckpt", TinyLM(), STEPS)
    single_state, (single_optim,) = single_device_view(tmp_path / "single-ckpt", TinyLM(), STEPS)
    assert sorted(pp_state) == sorted(single_state)
    for name, tensor in single_state.items():
        torch.testing.assert_close(pp_state[name], tensor, rtol=1e-3, atol=2e-4, msg=name)  # AdamW
    assert pp_optim["param_groups"] == single_optim["param_groups"]
    assert pp_optim["state"].keys() == single_optim["state"].keys()
    for idx, entry in single_optim["state"].items():
        torch.testing.assert_close(pp_optim["state"][idx]["exp_avg"], entry["exp_avg"], rtol=1e-3, atol=1e-6)


def test_layer_split_balances_and_obeys_override() -> None:
    assert balanced_layer_split(8, 2) == [range(0, 4), range(4, 8)]
    assert balanced_layer_split(8, 2, last_extra=2.0) == [range(0, 5), range(5, 8)]  # head costs 2 layers
    assert balanced_layer_split(8, 2, layers_per_stage=[3, 5]) == [range(0, 3), range(3, 8)]
    with pytest.raises(ValueError, match="sum"):
        balanced_layer_split(8, 2, layers_per_stage=[3, 4])


def test_config_errors_have_fix_its() -> None:
    with pytest.raises(ValueError, match=r"pp=5 is larger than the model's num_hidden_layers=4"):
        balanced_layer_split(4, 5)
    with pytest.raises(ValueError, match=r"at least pp=4 micro-batches.*accumulate_grad_batches"):
        check_micro_batches(4, "1f1b", 2)
    check_micro_batches(4, "afab", 2)  # all-forward-all-backward has no such requirement


def _too_few_micro_batches(rank: int, world: int, root: str) -> str:
    try:
        _fit(Parallel3DStrategy(pp=world), Path(root) / f"r{rank}", accum=1)
    except ValueError as err:
        return str(err)
    return "no error"


def test_trainer_rejects_too_few_micro_batches_for_1f1b(tmp_path: Path) -> None:
    errors = run_distributed(_too_few_micro_batches, 2, str(tmp_path), timeout=120)
    assert all("at least pp=2 micro-batches" in e for e in errors), errors


def _pretrained_worker(rank: int, world: int, path: str) -> bool:
    strategy = Parallel3DStrategy(pp=world, pretrained=path)
    strategy.setup_environment()
    module = TinyLM()
    with strategy.tensor_init_context():
        module.configure_model()  # on meta: nothing is initialised here
    strategy.setup_module(module)
    full = load_file(str(Path(path) / "model.safetensors"))
    for name, p in module.model.named_parameters():  # this stage's parameters, from the file
        assert torch.equal(p.detach(), full[name]), name
    return True


def test_pretrained_checkpoint_loads_per_stage(tmp_path: Path) -> None:
    from nanolight import save_pretrained

    model = LlamaForCausalLM(_config())
    model.init_weights(torch.Generator().manual_seed(123))
    save_pretrained(model, tmp_path / "pretrained")
    assert run_distributed(_pretrained_worker, 2, str(tmp_path / "pretrained")) == [True, True]


def _bf16_worker(rank: int, world: int, root: str) -> bool:
    strategy = Parallel3DStrategy(pp=world, precision="bf16-mixed")
    _fit(strategy, Path(root) / "pp")
    return True


def test_pp_bf16_mixed_matches_single_device(tmp_path: Path) -> None:
    """Under autocast the activations crossing stages keep the residual stream's dtype."""
    _fit(SingleDeviceStrategy("cpu", precision="bf16-mixed"), tmp_path / "single")
    run_distributed(_bf16_worker, 2, str(tmp_path), timeout=240, pg_timeout=60)
    ref, got = _metrics(tmp_path / "single"), _metrics(tmp_path / "pp")
    for step, value in ref["train/loss"].items():
        assert got["train/loss"][step] == pytest.approx(value, rel=1e-3), step
