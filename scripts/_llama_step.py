"""The full-step comparison of `bench_trainer.py --model <preset>`: NanoTrainer training the
recipe's module from a converted checkpoint vs transformers' LlamaForCausalLM from the same
Hugging Face checkpoint in a plain PyTorch loop.

Both get the same weights (one HF checkpoint, converted with `convert_hf_to_nanolight`), the same
token batches, accumulation, AdamW hyperparameters *and kernel* (the recipe's: foreach on CPU,
fused on CUDA; only the trainer and the model differ), warm-up + cosine LR schedule, gradient
clipping at 1.0 and loss logging every `log_every` steps.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from nanolight.callbacks import Callback
from nanolight.models import LlamaConfig
from nanolight.models.pretrained import convert_hf_to_nanolight
from nanolight.pretrain.config import OptimConfig
from nanolight.pretrain.module import CausalLMPretrain, adamw_kernel, warmup_cosine
from nanolight.strategies import SingleDeviceStrategy
from nanolight.trainer import NanoTrainer

Rate = tuple[float, float]


def checkpoints(preset: str, root: Path) -> tuple[Path, Path]:
    """An HF checkpoint of `preset` (transformers' own init, seed 0) and its nanolight conversion."""
    import transformers

    config = LlamaConfig.preset(preset)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf_dict(), use_cache=False))
    hf_model.save_pretrained(root / "hf")
    convert_hf_to_nanolight(root / "hf", root / "nanolight")
    return root / "hf", root / "nanolight"


def loader(args: argparse.Namespace, vocab: int) -> DataLoader:
    n = args.steps * args.accum * args.batch
    ids = torch.randint(0, vocab, (n, args.seq_len), generator=torch.Generator().manual_seed(0))
    return DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=args.batch, shuffle=False)


def runners(args: argparse.Namespace, root: Path, rates: Callable, now: Callable) -> dict[str, Callable]:
    hf_dir, nano_dir = checkpoints(args.model, root)
    config = LlamaConfig.preset(args.model)
    optim = OptimConfig()

    def sync(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def plain(args: argparse.Namespace, device: torch.device) -> Rate:
        import transformers

        model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa")
        model = model.to(device).train()
        opt = torch.optim.AdamW(
            model.parameters(), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
            weight_decay=optim.weight_decay, **adamw_kernel(device),
        )  # fmt: skip
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(optim.warmup_steps, args.steps, 0.1))
        it = iter(loader(args, config.vocab_size))
        sync(device)
        t0 = now()
        for step in range(1, args.steps + 1):
            opt.zero_grad(set_to_none=True)
            for _ in range(args.accum):
                x = next(it)["input_ids"].to(device, non_blocking=True)
                loss = model(input_ids=x, labels=x).loss
                (loss / args.accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            sched.step()
            if step % args.log_every == 0:
                loss.item()
        sync(device)
        return rates(args, t0)

    def nano(args: argparse.Namespace, device: torch.device) -> Rate:
        start: list[tuple[float, float]] = []

        class Start(Callback):
            def on_train_start(self, trainer, pl_module):
                sync(device)
                start.append(now())

        module = CausalLMPretrain(config, optim, args.seq_len, args.steps, init_from=str(nano_dir))
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = NanoTrainer(
                max_steps=args.steps, accumulate_grad_batches=args.accum, gradient_clip_val=1.0,
                log_every_n_steps=args.log_every, strategy=SingleDeviceStrategy(device), logger=False,
                enable_progress_bar=False, enable_checkpointing=False, callbacks=[Start()], default_root_dir=run_dir,
            )  # fmt: skip
            trainer.fit(module, loader(args, config.vocab_size))
        sync(device)
        return rates(args, start[0])

    return {"transformers+plain": plain, "nanolight": nano}
