"""``NanoTrainer(accelerator="cpu", devices=2)``, as a ported Lightning program writes it, on a plain
``nn.Module`` (no tp/pp plan): data parallelism over 2 processes with a ``DistributedSampler``
injected (``use_distributed_sampler=True``), so each rank reads only its half and the run equals
one process fed the same global batches (2B, unshuffled) -- final weights and the step losses to
1e-6, under automatic and under manual optimization (two optimizers, toggled). Also Lightning's
DataModule contract across processes: ``prepare_data`` once per node (local rank 0), its
``state_dict`` in the checkpoint, ``load_state_dict`` on resume; and manual optimization under
pipeline parallelism is an error on every rank, not a hang; and ``seed_everything(workers=True)``
seeding each dataloader worker from the trainer's own rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_distributed
from _tiny import TinyLM, token_loader
from _trainer_helpers import MLPModule, make_data
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from nanolight import Callback, NanoDataModule, NanoTrainer
from nanolight.errors import UsageError
from nanolight.strategies.parallel3d import Parallel3DStrategy

N, B, EPOCHS = 32, 4, 2  # per-rank batch B: 4 steps per epoch at dp=2, 8 steps in all


def _dataset() -> TensorDataset:
    """(x, y, sample index): the index column shows which samples a rank was given."""
    x, y = make_data(N).tensors
    return TensorDataset(x, y, torch.arange(N))


class Seen(MLPModule):
    """The MLP regression; records the sample indices of each batch and logs the loss both
    rank-local (Lightning's default) and ``sync_dist=True`` (the dp mean)."""

    def __init__(self) -> None:
        super().__init__(lr=0.02)
        self.indices: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.indices.append(idx.tolist())
        loss = self.loss((x, y))
        self.log("train/loss", loss)
        self.log("train/loss_sync", loss, sync_dist=True)
        return loss


class GAN(Seen):
    """Manual optimization as Lightning's GAN example writes it: two optimizers, each step
    toggled so the other's parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.critic: nn.Module | None = None

    def configure_model(self) -> None:
        super().configure_model()
        if self.critic is None:
            torch.manual_seed(1)
            self.critic = nn.Linear(1, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y, idx = batch
        self.indices.append(idx.tolist())
        opt_model, opt_critic = self.optimizers()
        self.toggle_optimizer(opt_critic)
        c_loss = nn.functional.mse_loss(self.critic(self.model(x).detach()).squeeze(-1), y)
        self.manual_backward(c_loss)
        opt_critic.step()
        opt_critic.zero_grad()
        self.untoggle_optimizer(opt_critic)
        self.toggle_optimizer(opt_model)
        loss = nn.functional.mse_loss(self.critic(self.model(x)).squeeze(-1), y)
        self.manual_backward(loss)
        opt_model.step()
        opt_model.zero_grad()
        self.untoggle_optimizer(opt_model)
        self.log("train/loss", loss)
        self.log("train/loss_sync", loss, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.model.parameters(), lr=0.02),
            torch.optim.SGD(self.critic.parameters(), lr=0.05),
        ]


class Record(Callback):
    """Per batch: ``train/loss`` as this rank logged it and the synced mean."""

    def __init__(self) -> None:
        self.local: list[float] = []
        self.synced: list[float] = []

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.local.append(float(trainer.callback_metrics["train/loss"]))
        self.synced.append(float(trainer.callback_metrics["train/loss_sync"]))


def _fit(module_cls: type[Seen], devices: int, batch_size: int) -> dict[str, Any]:
    record = Record()
    trainer = NanoTrainer(
        accelerator="cpu", devices=devices, max_epochs=EPOCHS, seed=0, logger=False, callbacks=[record],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = module_cls()
    trainer.fit(module, train_dataloaders=DataLoader(_dataset(), batch_size=batch_size, shuffle=False))
    loader = trainer.train_dataloader
    return {
        "world_size": trainer.world_size, "num_devices": trainer.num_devices, "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank, "is_global_zero": trainer.is_global_zero,
        "sampler": type(loader.sampler).__name__, "global_step": trainer.global_step,
        "indices": module.indices, "local": record.local, "synced": record.synced,
        "state": {k: v.numpy().copy() for k, v in module.state_dict().items()},  # tensors: not across processes
    }  # fmt: skip


def _devices_worker(rank: int, world: int, manual: bool) -> dict[str, Any]:
    return _fit(GAN if manual else Seen, devices=world, batch_size=B)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_devices_2_is_data_parallel_with_a_distributed_sampler(manual: bool) -> None:
    single = _fit(GAN if manual else Seen, devices=1, batch_size=2 * B)
    ranks = run_distributed(_devices_worker, 2, manual, timeout=120)
    assert [(r["world_size"], r["num_devices"], r["global_rank"], r["local_rank"], r["is_global_zero"])
            for r in ranks] == [(2, 2, 0, 0, True), (2, 2, 1, 1, False)]  # fmt: skip
    assert all(r["sampler"] == DistributedSampler.__name__ for r in ranks)
    assert single["world_size"] == 1 and single["sampler"] == "SequentialSampler"
    steps = EPOCHS * N // (2 * B)
    assert single["global_step"] == steps * (2 if manual else 1)  # manual: one per optimizer.step()
    assert all(r["global_step"] == single["global_step"] for r in ranks)
    # each rank saw only its half of every global batch (DistributedSampler: rank r gets r, r+2, ...)
    for r, out in enumerate(ranks):
        assert out["indices"] == [[i for i in g if i % 2 == r] for g in single["indices"]]
    # the logged loss is rank-local (no sync_dist), as in Lightning; the mean of the ranks' is the
    # one process's, and sync_dist=True gives that mean on every rank
    assert ranks[0]["local"] != ranks[1]["local"]
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["local"], ranks[1]["local"], strict=True)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(single["local"]), rtol=1e-6, atol=1e-6)
    for out in ranks:
        torch.testing.assert_close(
            torch.tensor(out["synced"]), torch.tensor(single["local"]), rtol=1e-6, atol=1e-6
        )
    assert ranks[0]["state"].keys() == single["state"].keys()
    for name, want in single["state"].items():
        got = [torch.from_numpy(r["state"][name]) for r in ranks]
        torch.testing.assert_close(got[0], got[1], rtol=0, atol=0, msg=name)  # the replicas agree
        torch.testing.assert_close(got[0], torch.from_numpy(want), rtol=1e-6, atol=1e-6, msg=name)


class CountingData(NanoDataModule):
    """Records prepare_data (as a file per call: ranks share nothing else) and checkpoint state."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root, self.loaded = Path(root), []
        self.epochs_served = 0

    def prepare_data(self) -> None:
        rank = torch.distributed.get_rank()
        (self.root / f"prepared-rank{rank}-{len(list(self.root.glob('prepared-*')))}").touch()

    def train_dataloader(self) -> DataLoader:
        self.epochs_served += 1
        return DataLoader(_dataset(), batch_size=B)

    def state_dict(self) -> dict[str, Any]:
        return {"epochs_served": self.epochs_served, "saved_by": torch.distributed.get_rank()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded.append(dict(state_dict))


def _datamodule_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    def trainer(steps: int) -> NanoTrainer:
        return NanoTrainer(
            accelerator="cpu", devices=world, max_steps=steps, seed=0, logger=False, default_root_dir=root,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip

    first, dm = trainer(3), CountingData(root)
    first.fit(Seen(), datamodule=dm)
    first.save_checkpoint(Path(root) / "ckpt", update_last=False)
    torch.distributed.barrier()
    dm2 = CountingData(root)
    dm2.epochs_served = 100 + rank  # what it holds before the resume
    trainer(5).fit(Seen(), datamodule=dm2, ckpt_path=str(Path(root) / "ckpt"))
    return {"loaded_first": dm.loaded, "loaded_resume": dm2.loaded}


def test_datamodule_state_and_prepare_data_under_two_processes(tmp_path: Path) -> None:
    ranks = run_distributed(_datamodule_worker, 2, str(tmp_path), timeout=120)
    # prepare_data: once per trainer call, on local rank 0 only
    assert sorted(p.name for p in tmp_path.glob("prepared-*")) == ["prepared-rank0-0", "prepared-rank0-1"]
    assert [r["loaded_first"] for r in ranks] == [[], []]
    # the checkpoint holds rank 0's state_dict (Lightning saves on rank 0), every rank loads it
    assert [r["loaded_resume"] for r in ranks] == [[{"epochs_served": 1, "saved_by": 0}]] * 2


class ManualLM(TinyLM):
    def __init__(self) -> None:
        super().__init__(seed=0)
        self.automatic_optimization = False

    def training_step(self, batch: dict, batch_idx: int) -> None:
        opt = self.optimizers()
        self.manual_backward(self.model(batch["input_ids"], labels=batch["labels"]))
        opt.step()
        opt.zero_grad()


def _pp_manual_worker(rank: int, world: int) -> str:
    trainer = NanoTrainer(
        strategy=Parallel3DStrategy(pp=2), max_steps=2, logger=False, use_distributed_sampler=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(UsageError) as info:
        trainer.fit(ManualLM(), train_dataloaders=token_loader(8))
    return str(info.value)


def test_manual_optimization_under_pipeline_parallelism_is_an_error_not_a_hang() -> None:
    messages = run_distributed(_pp_manual_worker, 2, timeout=90)
    assert all("manual optimization cannot run under pipeline parallelism" in m for m in messages), messages
    assert all("pp=1" in m for m in messages)


class _WorkerSeed(torch.utils.data.Dataset):
    """Each item is the torch seed of the process that loads it (a dataloader worker)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(float(torch.initial_seed()), dtype=torch.float64)


class _Passthrough(MLPModule):
    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return batch


def test_workers_are_seeded_from_the_global_seed_the_worker_and_the_trainers_rank(monkeypatch) -> None:
    """Worker w of global rank r gets seed + 1000003 r + 7919 w, with r the strategy's rank: a launch
    variable left in the environment (RANK=5 in a one-process run) is not read."""
    from nanolight.seed import seed_everything

    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # restored afterwards; seed_everything sets both
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    monkeypatch.setenv("RANK", "5")
    seed_everything(3, workers=True)
    loader = DataLoader(_WorkerSeed(), batch_size=1, num_workers=2)
    trainer = NanoTrainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    seeds = trainer.predict(_Passthrough(), dataloaders=loader)
    assert [int(s.item()) for s in seeds] == [3, 3 + 7919]  # workers 0 and 1 of rank 0
