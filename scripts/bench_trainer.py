"""Steps/s of NanoTrainer vs a plain PyTorch loop (and Lightning's Trainer when installed).

Same model, data, optimizer and accumulation for all; runs alternate (plain, nano, lightning)
for several repeats so machine noise hits all equally; the median of each is reported with
NanoTrainer's overhead relative to the plain loop (target: under 3%).

    python scripts/bench_trainer.py [--steps 200] [--repeats 5] [--width 1024] [--device cpu]

With ``--model <preset>`` (e.g. smollm-tiny) the model is a Llama instead of the MLP: NanoTrainer
trains the recipe's module from a converted checkpoint, the plain loop trains transformers'
LlamaForCausalLM from the same Hugging Face checkpoint (`_llama_step.py`); the full step, model
included, is compared (target: nanolight >= 1.05x).

    python scripts/bench_trainer.py --model smollm-tiny --seq-len 256 --batch 4 --accum 2 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _llama_step.py next to this script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout, not installed
from nanolight.module import NanoModule  # noqa: E402
from nanolight.strategies import SingleDeviceStrategy  # noqa: E402
from nanolight.trainer import NanoTrainer  # noqa: E402


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def make_loader(args: argparse.Namespace) -> DataLoader:
    n = args.steps * args.accum * args.batch
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, args.width, generator=g), torch.randn(n, generator=g))
    return DataLoader(ds, batch_size=args.batch, shuffle=False)


def loss_fn(model: nn.Module, batch, device: torch.device) -> torch.Tensor:
    x, y = (t.to(device, non_blocking=True) for t in batch)
    return nn.functional.mse_loss(model(x).squeeze(-1), y)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rates(args: argparse.Namespace, t0: tuple[float, float]) -> tuple[float, float]:
    """(wall, process-CPU) steps/s since ``t0``; CPU time is robust to other processes on a
    shared machine (with --threads 1 it is the work this process did)."""
    return args.steps / (time.perf_counter() - t0[0]), args.steps / (time.process_time() - t0[1])


def now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def run_plain(args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    model = make_model(args.width, args.depth).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    it = iter(make_loader(args))
    sync(device)
    t0 = now()
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        for _ in range(args.accum):
            loss = loss_fn(model, next(it), device)
            (loss / args.accum).backward()
        opt.step()
        if step % args.log_every == 0:
            loss.item()  # what a real loop does to print/log the loss
    sync(device)
    return rates(args, t0)


class BenchModule(NanoModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = make_model(args.width, args.depth)

    def training_step(self, batch, batch_idx):
        return loss_fn(self.model, batch, self.device)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _Timer:
    """Starts the clock at the first batch, as the plain loop's clock starts at its loop."""

    t0 = (0.0, 0.0)


def run_nano(args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    from nanolight.callbacks import Callback

    timer = _Timer()

    class Start(Callback):
        def on_train_start(self, trainer, pl_module):
            sync(device)
            timer.t0 = now()

    with tempfile.TemporaryDirectory() as root:
        trainer = NanoTrainer(
            max_steps=args.steps, accumulate_grad_batches=args.accum, log_every_n_steps=args.log_every,
            strategy=SingleDeviceStrategy(device), logger=False, enable_progress_bar=False,
            enable_checkpointing=False, callbacks=[Start()], default_root_dir=root,
        )  # fmt: skip
        trainer.fit(BenchModule(args), make_loader(args))
    sync(device)
    return rates(args, timer.t0)


def lightning_runner() -> Callable[[argparse.Namespace, torch.device], tuple[float, float]] | None:
    try:
        import lightning as L
    except ImportError:
        return None

    class LitModule(L.LightningModule):
        def __init__(self, args: argparse.Namespace) -> None:
            super().__init__()
            self.model = make_model(args.width, args.depth)

        def training_step(self, batch, batch_idx):
            return loss_fn(self.model, batch, self.device)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def run(args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
        timer = _Timer()

        class Start(L.Callback):
            def on_train_start(self, trainer, pl_module):
                sync(device)
                timer.t0 = now()

        with tempfile.TemporaryDirectory() as root:
            trainer = L.Trainer(
                max_steps=args.steps, accumulate_grad_batches=args.accum, log_every_n_steps=args.log_every,
                accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, logger=False,
                enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                callbacks=[Start()], default_root_dir=root, num_sanity_val_steps=0,
            )  # fmt: skip
            trainer.fit(LitModule(args), make_loader(args))
        sync(device)
        return rates(args, timer.t0)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument(
        "--model", default=None, help="a Llama preset (full step vs transformers); default: the MLP"
    )
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (--model only)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as root:
        if args.model is not None:
            from _llama_step import runners as llama_runners

            runners = llama_runners(args, Path(root), rates, now)
        else:
            runners = {"plain": run_plain, "nanolight": run_nano}
            lit = lightning_runner()
            if lit is not None:
                runners["lightning"] = lit
            else:
                print("lightning not installed: skipping the Lightning comparison")
        measure(args, device, runners)


def measure(args: argparse.Namespace, device: torch.device, runners: dict[str, Callable]) -> None:
    for fn in runners.values():  # warm-up (allocator, kernels, imports)
        fn(argparse.Namespace(**{**vars(args), "steps": 10}), device)
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in runners}
    for r in range(args.repeats):
        for name, fn in runners.items():
            results[name].append(fn(args, device))
        print(f"repeat {r + 1}: " + "  ".join(f"{k}={v[-1][0]:.2f}" for k, v in results.items()), flush=True)
    what = f"{args.model} T={args.seq_len}" if args.model else f"MLP {args.depth}x{args.width}"
    print(
        f"\n{args.steps} steps x {args.accum} micro-batches of {args.batch}, {what}, "
        f"{device}, median of {args.repeats}; time vs the first (+ = slower)"
    )
    first = next(iter(results))
    base = [statistics.median(v[i] for v in results[first]) for i in (0, 1)]
    for name, vals in results.items():
        wall, cpu = (statistics.median(v[i] for v in vals) for i in (0, 1))
        print(
            f"{name:>10}: wall {wall:8.2f} steps/s {100 * (base[0] / wall - 1):+6.2f}%   "
            f"cpu-time {cpu:8.2f} steps/s {100 * (base[1] / cpu - 1):+6.2f}%   "
            f"ratio {wall / base[0]:.3f} wall, {cpu / base[1]:.3f} cpu-time"
        )


if __name__ == "__main__":
    main()
