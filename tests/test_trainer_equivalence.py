"""The trainer computes what a hand-written PyTorch loop computes (fp32, CPU)."""

from __future__ import annotations

import torch
from _trainer_helpers import MLPModule, loader, make_data, make_mlp
from torch import nn

from nanolight.trainer import NanoTrainer


def _fit(tmp_path, module, data_loader, **kw) -> NanoTrainer:
    trainer = NanoTrainer(
        logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path, **kw
    )
    trainer.fit(module, data_loader)
    return trainer


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_accumulation_equals_one_big_batch(tmp_path):
    ds = make_data(32)
    small = MLPModule(lr=0.01)
    _fit(tmp_path, small, loader(ds, 2), max_steps=3, accumulate_grad_batches=4)
    big = MLPModule(lr=0.01)
    _fit(tmp_path, big, loader(ds, 8), max_steps=3, accumulate_grad_batches=1)
    for a, b in zip(_params(small), _params(big), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_clipping_and_scheduler_match_plain_pytorch(tmp_path):
    ds = make_data(64)
    steps, accum, clip = 5, 3, 0.5
    module = MLPModule(lr=0.05, scheduler=True)
    trainer = _fit(
        tmp_path,
        module,
        loader(ds, 4),
        max_steps=steps,
        accumulate_grad_batches=accum,
        gradient_clip_val=clip,
    )

    model = make_mlp()  # same seed -> same init
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    batches = iter(loader(ds, 4))
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accum):
            x, y = next(batches)
            (nn.functional.mse_loss(model(x).squeeze(-1), y) / accum).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        sched.step()

    for a, b in zip(_params(module.model), _params(model), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert torch.isclose(trainer.grad_norm, norms[-1], atol=1e-6)
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == sched.get_last_lr()
