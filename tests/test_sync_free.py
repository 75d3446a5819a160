"""A training step reads nothing back from the device except on logging steps.

Why: a host sync (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``) makes the
host wait for the device, so it cannot queue the next step's kernels while the device works;
one per step costs the launch latency every step. The recipe's fit (its callbacks, a CSV
logger, gradient clipping, checkpoints, validation) may read values only on the steps that log
(every ``log_every_n_steps``), save, validate, and at the end. Counted on CPU with
`_sync_count.SyncCounter`; on CUDA torch's own ``set_sync_debug_mode("error")`` checks the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _sync_count import SyncCounter
from _tiny import run_distributed, tiny_config, token_loader

from nanolight import Callback
from nanolight.callbacks import GreedySamples, NaNGuard
from nanolight.pretrain.config import CheckpointConfig, LoggerConfig, OptimConfig, PretrainConfig, TrainConfig
from nanolight.pretrain.module import CausalLMPretrain
from nanolight.pretrain.run import build_trainer
from nanolight.strategies import Parallel3DStrategy, SingleDeviceStrategy, Strategy

STEPS, LOG_EVERY, ACCUMULATE = 8, 4, 2
LOGGING = {4, 8}  # also the steps that validate and save (every 4), and 8 ends the run
QUIET = [s for s in range(1, STEPS + 1) if s not in LOGGING]


class Letters:
    """A tokenizer for GreedySamples: one id per character."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 128 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i % 90) for i in ids)


def _config(root: Path) -> PretrainConfig:
    return PretrainConfig(
        model=tiny_config(),
        trainer=TrainConfig(
            max_steps=STEPS, micro_batch_size=2, seq_len=16, accumulate_grad_batches=ACCUMULATE,
            gradient_clip_val=1.0, default_root_dir=str(root), log_every_n_steps=LOG_EVERY,
            val_check_interval=LOG_EVERY * ACCUMULATE, limit_val_batches=2, enable_progress_bar=True,
        ),
        optim=OptimConfig(warmup_steps=2),
        checkpoint=CheckpointConfig(every_n_steps=LOG_EVERY, keep_last_n=1),
        logger=LoggerConfig(csv=True, wandb=False),
    )  # fmt: skip


def _fit(root: Path, strategy: Strategy, *extra: Callback) -> Any:
    """The recipe's trainer (`build_trainer`: LR monitor, throughput, checkpoints, CSV logger, the
    progress bar) with GreedySamples, training the recipe's module on a tiny Llama."""
    config = _config(root)
    t = config.trainer
    module = CausalLMPretrain(config.model, config.optim, t.seq_len, t.max_steps)
    trainer = build_trainer(config, strategy, root, GreedySamples(Letters(), max_new_tokens=2), *extra)
    n = STEPS * ACCUMULATE * 2 * 4  # two epochs' worth per rank at dp=2: stops mid-epoch, at max_steps
    # the data module's batches (target_ids): the step counts its valid targets (over dp, on the device)
    trainer.fit(
        module,
        token_loader(n, batch_size=2, targets=True),
        token_loader(4, batch_size=2, seed=5, targets=True),
    )
    return trainer


def test_no_host_sync_outside_logging_steps(tmp_path: Path) -> None:
    counter = SyncCounter()
    with counter:
        trainer = _fit(tmp_path, SingleDeviceStrategy("cpu"), counter)
    assert trainer.global_step == STEPS and (tmp_path / "metrics.csv").is_file()
    quiet = {s: counter.counts[s] for s in QUIET}
    assert sum(quiet.values()) == 0, counter.report(QUIET)
    assert all(counter.counts[s] > 0 for s in LOGGING), dict(counter.counts)  # the count can fail


def test_nan_guard_reads_one_flag_per_step(tmp_path: Path) -> None:
    """NaNGuard must decide on the host before each update (see its docstring): one read of one
    device bool per step -- the loss and the grad norm checked together -- and nothing more."""
    counter = SyncCounter()
    with counter:
        _fit(tmp_path, SingleDeviceStrategy("cpu"), counter, NaNGuard())
    assert [counter.counts[s] for s in QUIET] == [1] * len(QUIET), counter.report(QUIET)


# ---- two processes: the pre-emption agreement stays off the per-step path ---------------------


def _fit_dp2(rank: int, world: int, root: str, signal_at: int | None) -> dict[str, Any]:
    class SignalOnRank1(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if rank == 1 and signal_at is not None and trainer.global_step + 1 == signal_at:
                trainer.preemption.received = "SIGTERM"  # what the handler records

    counter = SyncCounter()
    strategy = Parallel3DStrategy(dp=world)
    with counter:
        trainer = _fit(Path(root), strategy, counter, SignalOnRank1())
    return {
        "step": trainer.global_step, "preempted_by": trainer.preempted_by,
        "counts": {k: counter.counts[k] for k in counter.counts}, "where": dict(counter.where),
        "last": (Path(root) / "checkpoints" / "last").read_text().strip(),
        "drained": trainer.preemption._pending is None,  # no agreement left in flight after fit
    }  # fmt: skip


def test_dp2_no_host_sync_outside_logging_steps(tmp_path: Path) -> None:
    out = run_distributed(_fit_dp2, 2, str(tmp_path), None, timeout=240)
    for rank in out:
        assert rank["step"] == STEPS and rank["preempted_by"] is None
        quiet = {s: rank["counts"].get(s, 0) for s in QUIET}
        assert sum(quiet.values()) == 0, {s: rank["where"].get(s) for s in QUIET}
        assert all(rank["counts"].get(s, 0) > 0 for s in LOGGING), rank["counts"]
        assert rank["drained"]


def _agree(rank: int, world: int) -> list[int]:
    strategy = Parallel3DStrategy(dp=world)
    strategy.setup_environment()
    pending = strategy.agree_max([1, 2][rank])  # rank 0 got SIGUSR1, rank 1 SIGTERM: SIGTERM wins
    later = strategy.agree_max(0)  # a second one in flight at once keeps its order
    return [pending.wait(), later.wait(), strategy.agree_max(int(rank == 0)).wait()]


def test_agree_max_on_the_host() -> None:
    assert run_distributed(_agree, 2) == [[2, 0, 1]] * 2


def test_dp2_signal_on_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    at = 1  # rank 1 sees it during step 1; the ranks agree on it at step 2's check (no periodic save yet)
    out = run_distributed(_fit_dp2, 2, str(tmp_path), at, timeout=240)
    steps = {rank["step"] for rank in out}
    assert steps == {at + 1}, steps
    assert [rank["preempted_by"] for rank in out] == ["SIGTERM"] * 2
    assert out[0]["last"] == f"step-{at + 1}"
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["last", f"step-{at + 1}"], saved  # one checkpoint (keep_last_n=1 pruned none)


def test_dp2_signal_in_the_last_step_is_still_agreed(tmp_path: Path) -> None:
    """The last step's agreement is waited for when the loop ends: both ranks see the signal, the
    final step is saved once, nothing is left in flight."""
    out = run_distributed(_fit_dp2, 2, str(tmp_path), STEPS, timeout=240)
    assert [(r["step"], r["preempted_by"], r["drained"]) for r in out] == [(STEPS, "SIGTERM", True)] * 2
    assert out[0]["last"] == f"step-{STEPS}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sync_debug_mode_errors_on_no_quiet_step(tmp_path: Path) -> None:
    class SyncDebug(Callback):
        """torch raises on any synchronising CUDA call while the mode is "error"."""

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            quiet = (trainer.global_step + 1) not in LOGGING
            torch.cuda.set_sync_debug_mode("error" if quiet else "default")

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            torch.cuda.set_sync_debug_mode("default")

    try:
        trainer = _fit(tmp_path, SingleDeviceStrategy("cuda"), SyncDebug())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.global_step == STEPS
