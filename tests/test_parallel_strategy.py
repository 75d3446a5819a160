"""Parallel3DStrategy through NanoTrainer: tp runs match the single-device run, checkpoints are
full tensors in the single-device format and load at any layout."""

from __future__ import annotations

from pathlib import Path

import _tiny as tiny
import pytest
import torch
from _dist import run_distributed
from _tiny import full_state as single_device_view
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from nanolight import NanoTrainer
from nanolight.checkpoint import CheckpointReader
from nanolight.models import LlamaForCausalLM
from nanolight.strategies.base import SingleDeviceStrategy
from nanolight.strategies.parallel3d import Parallel3DStrategy

SEED, STEPS, ACCUM, MICRO, T = 11, 10, 2, 2, 16


class TinyLM(tiny.TinyLM):
    """Records every micro-batch's local loss (the tp ranks must agree bitwise)."""

    def __init__(self) -> None:
        super().__init__(seed=SEED)
        self.losses: list[float] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


def _loader() -> DataLoader:
    ids = torch.randint(0, 128, (STEPS * ACCUM * MICRO, T), generator=torch.Generator().manual_seed(3))
    return DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=MICRO)


def _fit(strategy: object, root: Path) -> tuple[NanoTrainer, TinyLM]:
    trainer = NanoTrainer(
        use_distributed_sampler=False,  # each rank is given its own data
        max_steps=STEPS,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=0.5,
        strategy=strategy,
        seed=SEED,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    module = TinyLM()
    trainer.fit(module, train_dataloaders=_loader())
    return trainer, module


def _tp_worker(rank: int, world: int, root: str, sp: bool) -> list[float]:
    root_path = Path(root)
    trainer, module = _fit(Parallel3DStrategy(tp=world, sequence_parallel=sp), root_path / f"tp{world}")
    trainer.save_checkpoint(root_path / "tp-ckpt", update_last=False)  # collective: gathers shards

    # load the single-device checkpoint: each rank keeps exactly its slices
    strategy = trainer.strategy
    strategy.load_checkpoint(root_path / "single-ckpt")
    full = CheckpointReader.open(root_path / "single-ckpt").model_state()
    group = strategy.parallel.context.tp_group
    from nanolight.parallel.tensor_parallel.apply import shard_chunks, shard_dims, take_shard

    dims, chunks = shard_dims(module), shard_chunks(module)
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), take_shard(full[name], dims[name], group, chunks.get(name, 1))), name
    return module.losses


@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["no-sp", "sp"])
def test_trainer_tp2_matches_single_device(tmp_path: Path, sp: bool) -> None:
    trainer, single = _fit(SingleDeviceStrategy("cpu"), tmp_path / "single")
    trainer.save_checkpoint(tmp_path / "single-ckpt", update_last=False)

    losses = run_distributed(_tp_worker, 2, str(tmp_path), sp, timeout=240, pg_timeout=60)
    assert losses[0] == losses[1]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(single.losses), rtol=1e-5, atol=0)

    # the tp checkpoint (per-rank shards) read on one device equals the single-device run
    tp_state, (tp_optim,) = single_device_view(tmp_path / "tp-ckpt", TinyLM(), STEPS)
    single_state, (single_optim,) = single_device_view(tmp_path / "single-ckpt", TinyLM(), STEPS)
    assert tp_state.keys() == single_state.keys()
    for name, tensor in single_state.items():
        torch.testing.assert_close(tp_state[name], tensor, rtol=1e-3, atol=2e-4, msg=name)  # 10 AdamW steps
    tp_optim = tp_optim["state"]
    for idx, entry in single_optim["state"].items():
        torch.testing.assert_close(tp_optim[idx]["exp_avg"], entry["exp_avg"], rtol=1e-3, atol=1e-6)


def _pretrained_worker(rank: int, world: int, path: str) -> bool:
    from nanolight.parallel.tensor_parallel.apply import shard_chunks, shard_dims, take_shard

    strategy = Parallel3DStrategy(tp=world, pretrained=path)
    strategy.setup_environment()
    module = TinyLM()
    with strategy.tensor_init_context():
        module.configure_model()  # on meta: nothing is initialised here
    strategy.setup_module(module)
    full = load_file(str(Path(path) / "model.safetensors"))
    dims, group = shard_dims(module.model), strategy.parallel.context.tp_group
    chunks = shard_chunks(module.model)
    for name, p in module.model.named_parameters():
        assert torch.equal(p.detach(), take_shard(full[name], dims[name], group, chunks.get(name, 1))), name
    return True


def test_pretrained_checkpoint_loads_sliced(tmp_path: Path) -> None:
    from nanolight import save_pretrained

    model = LlamaForCausalLM(tiny.tiny_config())
    model.init_weights(torch.Generator().manual_seed(123))
    save_pretrained(model, tmp_path / "pretrained")
    assert run_distributed(_pretrained_worker, 2, str(tmp_path / "pretrained")) == [True, True]


def test_strategy_takes_cp_from_its_arguments_and_its_config() -> None:
    """cp is a layout degree the strategy and its Hydra config accept (the runs: test_context_parallel);
    the world it plans is tp * pp * cp * dp."""
    from nanolight.parallel import ParallelConfig
    from nanolight.trainer.arguments import planned_processes

    assert Parallel3DStrategy(tp=2, cp=2).config.cp == 2
    config = ParallelConfig(tp=2, pp=2, dp=2, zero_stage=1, cp=2)
    strategy = Parallel3DStrategy.from_config(config)
    assert strategy.config == config and planned_processes(strategy) == 16
    assert strategy.parallel.sequence_multiple == 4 and strategy.parallel.cp == 2
