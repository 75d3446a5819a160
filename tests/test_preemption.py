"""Pre-emption: SIGTERM / SIGUSR1 make every rank finish the current optimizer step, save a
checkpoint and return from ``fit`` (exit 0), and ``ckpt_path="last"`` continues exactly.

In-process runs send the signal to themselves from ``training_step``; the recipe runs signal the
plain-python launcher (which passes it on to its ranks) or a single rank (the ranks agree on
stopping through ``Strategy.agree_max``, read one step later)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _dist import pythonpath
from _resume_run import DropoutMLP
from _trainer_helpers import make_data
from torch.utils.data import DataLoader

from nanolight.callbacks import Callback, ModelCheckpoint
from nanolight.trainer import NanoTrainer
from nanolight.trainer.preemption import Preemption


class SignalAt(Callback):
    """Records each step's loss (float.hex: exact) and signals this process during step `at`."""

    def __init__(self, at: int = 0, sig: int = signal.SIGTERM) -> None:
        self.at, self.sig, self.losses, self.step = at, sig, {}, 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step + 1 == self.at:  # every micro-batch of step `at`: handled once
            os.kill(os.getpid(), self.sig)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:  # the last micro-batch of a step: after its update
            self.step = trainer.global_step
            self.losses[trainer.global_step] = float(trainer.step_loss).hex()


def _fit(root: Path, max_steps: int, at: int = 0, sig: int = signal.SIGTERM, ckpt=True, resume=None):
    """The SIGKILL-resume test's run (dropout, shuffling, accumulation, clipping, LR schedule)."""
    rec = SignalAt(at, sig)
    callbacks = [rec] + (
        [
            ModelCheckpoint(
                every_n_train_steps=4, keep_last_n=2, filename="step-{step}", auto_insert_metric_name=False
            )
        ]
        if ckpt
        else []
    )
    trainer = NanoTrainer(
        use_distributed_sampler=False,  # each rank is given its own data
        max_steps=max_steps, accumulate_grad_batches=2, gradient_clip_val=1.0, seed=1234,
        callbacks=callbacks, logger=False, enable_progress_bar=False, default_root_dir=root,
        enable_checkpointing=ckpt,
    )  # fmt: skip
    module = DropoutMLP(lr=0.02, scheduler=True)
    train = DataLoader(make_data(64), batch_size=4, shuffle=True)
    trainer.fit(module, train, ckpt_path=resume)
    return trainer, module, rec.losses


def _last(root: Path) -> str:
    return (root / "checkpoints" / "last").read_text().strip()


@pytest.mark.parametrize(("sig", "ckpt"), [(signal.SIGTERM, True), (signal.SIGUSR1, False)])
def test_signal_saves_step_and_resume_is_bit_identical(tmp_path, capfd, sig, ckpt) -> None:
    steps, at = 12, 6  # 8 steps per epoch: stop mid-epoch, the resumed run crosses an epoch
    _, full_module, ref = _fit(tmp_path / "full", steps, ckpt=ckpt)
    before = signal.getsignal(sig)

    trainer, _, first = _fit(tmp_path / "run", steps, at=at, sig=sig, ckpt=ckpt)
    assert trainer.global_step == at and trainer.preempted_by == sig.name
    assert _last(tmp_path / "run") == f"step-{at}" and (tmp_path / "run" / "checkpoints" / "step-6").is_dir()
    assert signal.getsignal(sig) is before  # the previous handler is back after fit
    err = capfd.readouterr().err
    assert f"{sig.name} received: finished step {at}, saved " in err and "step-6" in err

    trainer, module, rest = _fit(tmp_path / "run", steps, ckpt=ckpt, resume="last")
    assert trainer.global_step == steps and trainer.preempted_by is None
    assert {**first, **rest} == ref  # exact, step by step
    a, b = full_module.state_dict(), module.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_signal_at_a_periodic_checkpoint_step_still_stops(tmp_path) -> None:
    trainer, _, losses = _fit(tmp_path, 12, at=4)  # ModelCheckpoint saves step 4 itself: no second save
    assert trainer.global_step == 4 and sorted(losses) == [1, 2, 3, 4]
    assert _last(tmp_path) == "step-4"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last", "step-4"]


def test_without_last_pointer_the_hint_names_the_saved_directory(tmp_path, capfd) -> None:
    trainer = NanoTrainer(
        use_distributed_sampler=False,  # each rank is given its own data
        max_steps=12, callbacks=[SignalAt(3), ModelCheckpoint(every_n_train_steps=4, save_last=False, filename="step-{step}", auto_insert_metric_name=False)],
        logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(DropoutMLP(lr=0.02), DataLoader(make_data(64), batch_size=4))
    saved = tmp_path / "checkpoints" / "step-3"
    assert trainer.global_step == 3 and saved.is_dir() and not (tmp_path / "checkpoints" / "last").exists()
    assert f"continue with ckpt_path='{saved}'" in capfd.readouterr().err


def test_handlers_restored_after_a_failed_fit(tmp_path) -> None:
    class Boom(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            assert signal.getsignal(signal.SIGTERM) is not sentinel  # installed during fit
            raise RuntimeError("boom")

    def sentinel(signum, frame) -> None:
        raise AssertionError("not expected")

    previous = {s: signal.signal(s, sentinel) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        trainer = NanoTrainer(use_distributed_sampler=False, max_steps=3, callbacks=[Boom()], logger=False, enable_progress_bar=False,
                              enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
        with pytest.raises(RuntimeError, match="boom"):
            trainer.fit(DropoutMLP(), DataLoader(make_data(16), batch_size=4))
        assert signal.getsignal(signal.SIGTERM) is sentinel and signal.getsignal(signal.SIGUSR1) is sentinel
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_no_handlers_outside_the_main_thread() -> None:
    """Python only lets the main thread install handlers: a fit in a thread runs without them."""
    seen = []

    class Owner:
        preempted_by = "stale"

    def body() -> None:
        with Preemption(Owner()) as p:  # would raise ValueError if it tried signal.signal here
            seen.append(dict(p._previous))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [{}]


def _any_flag(rank: int, world: int) -> list[bool]:
    import torch.distributed as dist

    from nanolight.strategies.parallel3d import Parallel3DStrategy

    strategy = Parallel3DStrategy(dp=world)
    strategy.setup_environment()
    if world == 1:  # asked every step: one process must not pay for a collective
        dist.all_reduce = None  # type: ignore[assignment]
    flags = [False, rank == world - 1, True]  # set on no rank, on the last one, on every one
    return [bool(strategy.agree_max(int(flag)).wait()) for flag in flags]


@pytest.mark.parametrize("world", [1, 2])
def test_agree_max_of_a_flag_over_the_world(world: int) -> None:
    from _dist import run_distributed

    assert run_distributed(_any_flag, world) == [[False, True, True]] * world


# ---- through the recipe: the plain-python launcher and its two ranks ------------------------

REPO = Path(__file__).resolve().parents[1]
RECIPE_ARGS = [
    "data.embedded_max_mb=2", "data.tokenizer_train_mb=1", "trainer.micro_batch_size=4",
    "trainer.seq_len=64", "trainer.log_every_n_steps=1", "trainer.val_check_interval=6",
    "trainer.limit_val_batches=2", "optim.warmup_steps=2",
    "optim.min_lr_ratio=1.0",  # constant LR after warm-up: the schedule does not depend on max_steps
    "logger=csv",
]  # fmt: skip


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nanolight-cache")


def _recipe_cmd(run_dir: Path, cache: Path, *overrides: str) -> list[str]:
    script = str(REPO / "recipes" / "smollm.py")
    return [sys.executable, script, f"trainer.default_root_dir={run_dir}", f"data.cache_dir={cache}",
            *RECIPE_ARGS, *overrides]  # fmt: skip


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": pythonpath(REPO)}


def _recipe(run_dir: Path, cache: Path, *overrides: str) -> None:
    cmd = _recipe_cmd(run_dir, cache, *overrides)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=run_dir.parent, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]


def _losses(run_dir: Path) -> dict[int, float]:
    from test_recipe_e2e import losses

    return losses(run_dir)


def _children(pid: int) -> list[int]:
    from test_recipe_parallel import _children as children

    return children(pid)


def _preempt(run_dir: Path, cache: Path, sig: int, to_child: int | None, *overrides: str) -> tuple[int, str]:
    """Start a long 2-rank run, signal it once a few steps are logged; (exit code, stderr)."""
    run_dir.mkdir(parents=True)
    cmd = _recipe_cmd(run_dir, cache, "trainer.max_steps=100000", *overrides)
    parent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              cwd=run_dir.parent, env=_env())  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (len(_losses_or_empty(run_dir)) >= 3 and len(_children(parent.pid)) == 2):
            assert parent.poll() is None and time.monotonic() < deadline, "the run never started training"
            time.sleep(0.3)
        os.kill(parent.pid if to_child is None else _children(parent.pid)[to_child], sig)
        _, err = parent.communicate(timeout=120)
        return parent.returncode, err
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _losses_or_empty(run_dir: Path) -> dict[int, float]:
    try:
        return _losses(run_dir)
    except (OSError, ValueError, KeyError):
        return {}  # not written yet, or a row half written


def _stopped_step(run_dir: Path, err: str, sig: int) -> int:
    step = int(_last(run_dir).removeprefix("step-"))
    assert f"nanolight: {sig.name} received: finished step {step}, saved " in err, err[-3000:]
    assert max(_losses(run_dir)) == step  # no step ran after the saved one
    return step


@pytest.mark.slow
def test_recipe_sigterm_to_launcher_saves_and_resumes_exactly(tmp_path: Path, cache_dir: Path) -> None:
    run = tmp_path / "run"
    code, err = _preempt(run, cache_dir, signal.SIGTERM, None, "+parallel.tp=2")
    assert code == 0, err[-3000:]
    n = _stopped_step(run, err, signal.SIGTERM)
    first = _losses(run)

    _recipe(run, cache_dir, f"trainer.max_steps={n + 3}", "checkpoint.resume=last", "+parallel.tp=2")
    ref_dir = tmp_path / "ref"
    _recipe(ref_dir, cache_dir, f"trainer.max_steps={n + 3}", "+parallel.tp=2")
    ref, got = _losses(ref_dir), _losses(run)
    assert sorted(got) == list(range(1, n + 4))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-6, abs=0), (step, got[step], ref[step])
    assert all(first[s] == got[s] for s in first)


@pytest.mark.slow
def test_recipe_sigusr1_to_one_rank_stops_every_rank(tmp_path: Path, cache_dir: Path) -> None:
    run = tmp_path / "run"
    code, err = _preempt(run, cache_dir, signal.SIGUSR1, 1, "+parallel.dp=2")
    assert code == 0, err[-3000:]  # both ranks exited 0: they stopped at the same step
    _stopped_step(run, err, signal.SIGUSR1)
