"""``precision="bf16-master"`` on one process: bf16 compute, fp32 master weights and main gradients.

Each proof against a reference nobody here wrote: micro-batch gradients summed in fp32 (not a bf16
running sum), the masters after N steps equal to ``torch.optim.AdamW`` (with torch's own
clipping and a LambdaLR schedule) stepping fp32 parameters with the same gradients, the losses
within bf16 tolerance of ``bf16-mixed``, activations bf16 between blocks, and checkpoints that
hold the fp32 masters (resumed exactly; loaded by ``32-true`` and from it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _tiny import StepLosses, TinyLM, token_loader

from nanolight import Callback, NanoTrainer
from nanolight.checkpoint import CheckpointReader
from nanolight.parallel.zero import masters_in_model
from nanolight.precision import Precision
from nanolight.strategies import SingleDeviceStrategy

SEED = 1


def _trainer(
    precision: str, steps: int, accumulate: int = 1, clip: float | None = None, **kw: Any
) -> NanoTrainer:
    kw = {"logger": False, "enable_progress_bar": False, "enable_checkpointing": False, **kw}
    return NanoTrainer(
        max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
        strategy=SingleDeviceStrategy("cpu", precision=precision), **kw,
    )  # fmt: skip


class MasterGrads(Callback):
    """Each step's fp32 main gradient of every parameter (before clipping), by name."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        (zero,) = trainer.optimizers  # bf16-master: a one-rank ZeroOptimizer
        self.steps.append({n: zero.reducer.grad_view(p).clone() for n, p in pl_module.named_parameters()})


def _masters(trainer: NanoTrainer, module: TinyLM) -> dict[str, torch.Tensor]:
    with masters_in_model(trainer.optimizers):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_precision_names_and_checks() -> None:
    p = Precision("bf16-master")
    assert p.master_weights and p.compute_dtype == torch.bfloat16
    assert not Precision("bf16-mixed").master_weights
    with pytest.raises(ValueError, match="bf16-master"):
        Precision("bf16-masters")


def test_micro_batch_gradients_accumulate_in_fp32() -> None:
    """The main gradient after 4 micro-batches is the fp32 sum of the 4 bf16 micro-batch gradients
    (each computed alone on a copy of the bf16 model); a bf16 running sum differs from it."""
    grads = MasterGrads()
    module = TinyLM(seed=SEED)
    _trainer("bf16-master", steps=1, accumulate=4, callbacks=[grads]).fit(module, token_loader(8))
    ref = TinyLM(seed=SEED)
    ref.configure_model()
    ref.to(torch.bfloat16)  # the step's compute weights: the fp32 init cast once
    parts = []
    for batch in token_loader(8):
        ref.zero_grad(set_to_none=True)
        (ref.model(batch["input_ids"], labels=batch["labels"]) / 4).backward()  # the trainer's loss_i / 4
        parts.append({n: p.grad.clone() for n, p in ref.named_parameters()})
    fp32_sum = {n: sum(part[n].float() for part in parts) for n in parts[0]}
    bf16_sum = {n: sum(part[n] for part in parts) for n in parts[0]}
    (got,) = grads.steps
    for name, want in fp32_sum.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want), f"{name}: not the fp32 sum of the micro-batch gradients"
    assert any(not torch.equal(bf16_sum[n].float(), fp32_sum[n]) for n in fp32_sum)  # the test can tell


def test_masters_step_like_torch_adamw() -> None:
    """After 4 steps (clipping, a warm-up schedule) the fp32 masters equal torch.optim.AdamW + torch's
    clip_grad_norm_ + LambdaLR stepping fp32 parameters from the same init with the same gradients."""
    grads = MasterGrads()
    module = TinyLM(seed=SEED, warmup=3, decay_groups=True)
    trainer = _trainer("bf16-master", steps=4, accumulate=2, clip=0.5, callbacks=[grads])
    trainer.fit(module, token_loader(16))
    got = _masters(trainer, module)
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())  # the model computes in bf16
    (zero,) = trainer.optimizers
    assert all(v.dtype == torch.float32 for st in zero.state.values() for v in st.values() if v.dim() > 0)

    ref = TinyLM(seed=SEED, warmup=3, decay_groups=True)
    ref.configure_model()  # fp32, the same init
    conf = ref.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    params = dict(ref.named_parameters())
    for step in grads.steps:
        for name, p in params.items():
            p.grad = step[name].clone()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5)
        opt.step()
        sched.step()
    for name, p in params.items():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        # the bf16 weights are the masters rounded once
        assert torch.equal(dict(module.named_parameters())[name].detach(), got[name].to(torch.bfloat16))


def _fp32_bytes_per_param(zero: Any, module: torch.nn.Module) -> float:
    """fp32 bytes the optimizer and its reducer hold per parameter: distinct storages of the
    main-gradient buckets, the gradient shards, the masters and the optimizer state."""
    tensors = [b.buffer for b in zero.reducer.buckets] + list(zero.shard_grads) + list(zero.master)
    tensors += [v for st in zero.state.values() for v in st.values() if v.dim() > 0]
    assert {t.dtype for t in tensors} == {torch.float32}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) / sum(p.numel() for p in module.parameters())


def test_one_process_holds_16_fp32_bytes_per_param() -> None:
    """One process (dp=1): 4 B/param of fp32 main gradients (the gradient shard the masters step
    with is the buckets themselves, not a copy) + 12 of master weights and AdamW's two moments."""
    module = TinyLM(seed=SEED, decay_groups=True)  # two param groups: two flat shards
    trainer = _trainer("bf16-master", steps=1, accumulate=2, clip=0.5)
    trainer.fit(module, token_loader(4))
    (zero,) = trainer.optimizers
    assert len(zero.shard_grads) == 2
    assert _fp32_bytes_per_param(zero, module) == 4 + 12


def test_losses_within_bf16_tolerance_of_bf16_mixed() -> None:
    """The same run under bf16-mixed and bf16-master: losses and gradient norms agree to bf16
    accuracy (kernels differ by instruction set: a tolerance, not recorded values)."""
    runs = {}
    for precision in ("bf16-mixed", "bf16-master"):
        seen = StepLosses()
        _trainer(precision, steps=6, accumulate=2, clip=1.0, callbacks=[seen]).fit(
            TinyLM(seed=SEED), token_loader(24)
        )
        runs[precision] = seen
    mixed, master = runs["bf16-mixed"], runs["bf16-master"]
    assert len(master.losses) == 6
    torch.testing.assert_close(torch.tensor(master.losses), torch.tensor(mixed.losses), rtol=0, atol=0.03)
    torch.testing.assert_close(torch.tensor(master.norms), torch.tensor(mixed.norms), rtol=0.05, atol=0)


class BlockDtypes(Callback):
    """The dtype of every decoder block's output (the residual stream between blocks)."""

    def __init__(self) -> None:
        self.dtypes: set[torch.dtype] = set()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for block in pl_module.model.model.layers:
            block.register_forward_hook(lambda _m, _a, out: self.dtypes.add(out.dtype))


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16-master", torch.bfloat16), ("bf16-mixed", torch.float32)]
)
def test_activations_between_blocks(precision: str, dtype: torch.dtype) -> None:
    seen = BlockDtypes()
    _trainer(precision, steps=1, callbacks=[seen]).fit(TinyLM(seed=SEED), token_loader(2))
    assert seen.dtypes == {dtype}


def _fit(precision: str, steps: int, root: Path, ckpt: str | None = None, every: int | None = None) -> Any:
    from nanolight.callbacks import ModelCheckpoint

    seen = StepLosses()
    callbacks: list[Callback] = [seen]
    if every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=root,
                filename="step-{step}",
                auto_insert_metric_name=False,
                every_n_train_steps=every,
                save_top_k=-1,
            )  # fmt: skip
        )
    trainer = _trainer(
        precision, steps, accumulate=2, clip=1.0, callbacks=callbacks, enable_checkpointing=bool(every)
    )
    module = TinyLM(seed=SEED, warmup=2)
    trainer.fit(module, token_loader(16), ckpt_path=ckpt)
    return trainer, module, seen


def test_checkpoint_holds_fp32_masters_and_resumes_exactly(tmp_path: Path) -> None:
    """Save at step 2 under bf16-master: the file holds the fp32 masters (not the bf16 weights); a
    resume for steps 3-4 under bf16-master equals the uninterrupted run exactly; 32-true loads
    the masters as its weights, and a 32-true checkpoint becomes bf16-master's masters exactly."""
    whole, whole_module, whole_seen = _fit("bf16-master", 4, tmp_path / "whole", every=2)
    ckpt = tmp_path / "whole" / "step-2"
    saved = CheckpointReader.open(ckpt).model_state()
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in saved.values())  # not bf16 values

    resumed, resumed_module, resumed_seen = _fit("bf16-master", 4, tmp_path / "resumed", ckpt=str(ckpt))
    assert resumed_seen.losses == whole_seen.losses[2:]
    want, got = _masters(whole, whole_module), _masters(resumed, resumed_module)
    assert all(torch.equal(got[n], want[n]) for n in want)
    want_state, got_state = whole.optimizers[0].state_dict(), resumed.optimizers[0].state_dict()
    for k, st in want_state["state"].items():
        assert all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(got_state["state"][k][s])) for s, v in st.items()
        )

    fp32, fp32_module, _ = _fit(
        "32-true", 2, tmp_path / "fp32", ckpt=str(ckpt)
    )  # max_steps reached: loads only
    assert all(torch.equal(p.detach(), saved[n]) for n, p in fp32_module.state_dict(keep_vars=True).items())

    _fit("32-true", 2, tmp_path / "from32", every=2)
    master, master_module, _ = _fit(
        "bf16-master", 2, tmp_path / "to-master", ckpt=str(tmp_path / "from32" / "step-2")
    )
    from32 = CheckpointReader.open(tmp_path / "from32" / "step-2").model_state()
    got = _masters(master, master_module)
    assert all(torch.equal(got[n], from32[n]) for n in got)
    assert {p.dtype for p in master_module.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("user_choice", [None, "medium"])
def test_32_true_on_cuda_enables_tf32_unless_the_user_chose(user_choice: str | None) -> None:
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision(user_choice or "highest")
        Precision("bf16-master").setup_device(torch.device("cuda"))
        Precision("32-true").setup_device(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == (user_choice or "highest")
        Precision("32-true").setup_device(torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == (user_choice or "high")
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_recipe_precision_auto_is_bf16_master_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanolight.pretrain.config import TrainConfig

    assert TrainConfig().run_precision == "32-true"  # CPU runs and tests keep their numbers
    assert TrainConfig(precision="bf16-mixed").run_precision == "bf16-mixed"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert TrainConfig().run_precision == "bf16-master"


def test_recipe_precision_auto_falls_back_to_autocast_for_plain_dp(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16-master keeps its masters in ZeRO-1's optimizer, which refuses dp > 1 without it: the
    recipe's `auto` then picks bf16-mixed instead of an error at the first step."""
    from nanolight.parallel.config import ParallelConfig
    from nanolight.pretrain.config import PretrainConfig
    from nanolight.pretrain.run import build_strategy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for parallel, want in [
        (ParallelConfig(dp=2), "bf16-mixed"),
        (ParallelConfig(cp=2), "bf16-mixed"),  # cp ranks are replicas of the weights too
        (ParallelConfig(dp=2, zero_stage=1), "bf16-master"),
        (ParallelConfig(tp=2), "bf16-master"),
    ]:
        assert build_strategy(PretrainConfig(parallel=parallel)).precision.mode == want, parallel
