"""The step's loss and gradients are the exact token mean of the global batch -- every valid target
of every micro-batch on every dp rank -- whatever the layout and the micro-batch split.

The data is the hard case: many short packed documents with document masking, so each row, and so
each micro-batch, holds a different number of valid targets (a document's last token predicts
nothing). A mean of micro-batch means then depends on how the global batch is cut; the token mean
does not. References: `F.cross_entropy(..., reduction="sum") / count` by hand, and one process at
the same global batch (fp32, 1e-6).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tiny import StepLosses, TinyLM, run_distributed, tiny_config
from torch.utils.data import DataLoader

from nanolight import Callback, NanoTrainer
from nanolight.checkpoint import CheckpointReader
from nanolight.data.loader import make_batch
from nanolight.models import LlamaForCausalLM
from nanolight.models.fused_loss import linear_cross_entropy
from nanolight.strategies.base import SingleDeviceStrategy
from nanolight.strategies.parallel3d import Parallel3DStrategy

SEED, STEPS, GLOBAL, T, EOS = 5, 3, 4, 32, 1  # GLOBAL: rows per optimizer step


def _rows() -> torch.Tensor:
    """STEPS global batches of GLOBAL rows: random tokens, about one in four an EOS."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 128, (STEPS, GLOBAL, T), generator=g)
    return ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.25, EOS)


def _loader(micro: int, dp: int = 1, dp_rank: int = 0) -> DataLoader:
    """Micro-batches of `micro` rows; dp rank r reads the r-th contiguous slice of each global batch."""
    per = GLOBAL // dp
    rows = _rows()[:, dp_rank * per : (dp_rank + 1) * per].reshape(-1, T)
    batch = make_batch(rows, EOS)  # target_ids shifted here, boundaries dropped (document masking)
    per_token = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.shape == rows.shape}
    return DataLoader([{k: v[r] for k, v in per_token.items()} for r in range(len(rows))], batch_size=micro)


class DocLM(TinyLM):
    """The recipe's two-line training_step: the model's own loss on the data's shifted targets."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(
            batch["input_ids"], target_ids=batch["target_ids"], position_ids=batch["position_ids"],
            document_ids=batch["document_ids"],
        )  # fmt: skip
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        # SGD: the weights after N steps read the gradients back faithfully. AdamW's normalised
        # update turns last-bit differences of near-zero gradient elements (float summation order)
        # into lr-sized steps: ~2e-6 relative on weights even between two micro-batch splits
        # without document masking, where every micro-batch holds the same number of targets.
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _module() -> DocLM:
    return DocLM(tiny_config(layers=4), seed=SEED)


def _fit(
    strategy: Any,
    loader: DataLoader,
    accumulate: int,
    *callbacks: Callback,
    steps: int = STEPS,
    ckpt_path: str | None = None,
) -> tuple[NanoTrainer, DocLM]:
    trainer = NanoTrainer(
        use_distributed_sampler=False, max_steps=steps, accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0, strategy=strategy, seed=SEED, logger=False, callbacks=list(callbacks),
        enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    module = _module()
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return trainer, module


def _single(micro: int) -> tuple[StepLosses, dict[str, torch.Tensor]]:
    record = StepLosses()
    _, module = _fit(SingleDeviceStrategy("cpu"), _loader(micro), GLOBAL // micro, record)
    return record, {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_same(a: tuple[StepLosses, dict], b: tuple[StepLosses, dict]) -> None:
    """Losses, grad norms and weights after STEPS steps agree to 1e-6 (fp32)."""
    (ra, wa), (rb, wb) = a, b
    assert len(ra.losses) == len(rb.losses) == STEPS
    torch.testing.assert_close(torch.tensor(ra.losses), torch.tensor(rb.losses), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(ra.norms), torch.tensor(rb.norms), rtol=1e-6, atol=0)
    assert wa.keys() == wb.keys()
    for name, tensor in wa.items():
        rel = torch.linalg.vector_norm(wb[name] - tensor) / torch.linalg.vector_norm(tensor)
        assert rel <= 1e-6, f"{name}: relative error {rel:.3g}"


# ---- the exact token mean, by hand ---------------------------------------------------------------
class _Grads(Callback):
    """The step's loss and the gradients the optimizer is about to apply."""

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.loss = trainer.step_loss.detach().clone()
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()}


def test_unequal_micro_batches_give_the_exact_token_mean() -> None:
    micro, accumulate = 1, GLOBAL
    batches = list(_loader(micro))[:accumulate]  # the first step's micro-batches
    counts = [int((b["target_ids"] != -100).sum()) for b in batches]
    assert len(set(counts)) > 1, counts  # unequal valid targets per micro-batch: the case that matters

    reference = LlamaForCausalLM(tiny_config(layers=4))
    reference.init_weights(torch.Generator().manual_seed(SEED))  # DocLM's initial weights
    sums = []
    for b in batches:
        logits = reference(b["input_ids"], position_ids=b["position_ids"], document_ids=b["document_ids"])
        sums.append(F.cross_entropy(logits.flatten(0, 1), b["target_ids"].flatten(), reduction="sum"))
    token_mean = torch.stack(sums).sum() / sum(counts)
    token_mean.backward()
    mean_of_means = torch.stack([s / c for s, c in zip(sums, counts, strict=True)]).mean()
    assert abs(mean_of_means - token_mean) > 1e-5 * token_mean  # the two differ here: the test can fail

    grads = _Grads()
    trainer = NanoTrainer(
        max_steps=1, accumulate_grad_batches=accumulate, strategy=SingleDeviceStrategy("cpu"), seed=SEED,
        logger=False, callbacks=[grads], enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    module = _module()
    trainer.fit(module, train_dataloaders=_loader(micro))
    torch.testing.assert_close(grads.loss, token_mean.detach(), rtol=1e-6, atol=0)
    for name, p in reference.named_parameters():
        rel = torch.linalg.vector_norm(grads.grads[name] - p.grad) / torch.linalg.vector_norm(p.grad)
        assert rel <= 1e-6, f"{name}: relative error {rel:.3g}"  # float summation order only
    # outside a training step the model's loss is the plain mean again, and labels= keeps HF's meaning
    assert module.model.loss_divisor is None
    b, model = batches[0], module.model
    fields = {"position_ids": b["position_ids"], "document_ids": b["document_ids"]}
    mean = F.cross_entropy(model(b["input_ids"], **fields).flatten(0, 1), b["target_ids"].flatten())
    torch.testing.assert_close(
        model(b["input_ids"], target_ids=b["target_ids"], **fields), mean, rtol=1e-6, atol=0
    )
    torch.testing.assert_close(
        model(b["input_ids"], labels=b["input_ids"], **fields), mean, rtol=1e-6, atol=0
    )


def test_the_fused_head_and_loss_sum_like_cross_entropy() -> None:
    """``reduction="sum"`` (what the model divides by the step's count): value and gradients."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 24, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (2, 24), generator=g).masked_fill(
        torch.rand(2, 24, generator=g) < 0.3, -100
    )
    got = linear_cross_entropy(hidden, weight, targets, rows=7, reduction="sum")
    got.backward(torch.tensor(0.5))
    got_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten(), reduction="sum")
    (want * 0.5).backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_grads, (hidden.grad, weight.grad), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not both"):
        LlamaForCausalLM(tiny_config())(targets[:, :8] % 40, labels=targets[:, :8], target_ids=targets[:, :8])


def test_the_micro_batch_split_does_not_change_the_step() -> None:
    """One process, the same global batch cut into 4 x 1 rows, 2 x 2 and 1 x 4."""
    reference = _single(2)
    _assert_same(_single(1), reference)
    _assert_same(_single(4), reference)


# ---- every layout equals one process ----------------------------------------------------------------
def _worker(
    rank: int,
    world: int,
    tp: int,
    pp: int,
    zero_stage: int,
    schedule: str,
    micro: int,
    root: str,
    cp: int = 1,
    options: dict | None = None,
) -> Any:
    dp = world // (tp * pp * cp)
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    extra = options or {}
    strategy = Parallel3DStrategy(
        tp=tp, pp=pp, dp=dp, cp=cp, zero_stage=zero_stage, pp_schedule=schedule, pp_virtual=virtual, **extra
    )
    strategy.setup_environment()
    record = StepLosses()
    loader = _loader(micro, dp, strategy.parallel.context.dp_rank)
    trainer, _ = _fit(strategy, loader, GLOBAL // (dp * micro), record)
    trainer.save_checkpoint(Path(root) / "ckpt", update_last=False)  # collective: every rank's shards
    if rank != 0:
        return None
    state = CheckpointReader.open(Path(root) / "ckpt").model_state()
    return record.losses, record.norms, {k: v.numpy() for k, v in state.items()}


def _check_layout(
    tmp_path: Path,
    tp: int,
    pp: int,
    dp: int,
    micro: int,
    zero_stage: int = 0,
    schedule: str = "1f1b",
    cp: int = 1,
    **options: Any,
) -> None:
    """`options`: more `Parallel3DStrategy` arguments (sequence_parallel, activation_checkpointing, compile)."""
    reference = _single(2)
    world = tp * pp * dp * cp
    out = run_distributed(
        _worker,
        world,
        tp,
        pp,
        zero_stage,
        schedule,
        micro,
        str(tmp_path),
        cp,
        options,
        timeout=600,
        pg_timeout=90,
    )
    losses, norms, state = out[0]
    record = StepLosses()
    record.losses, record.norms = losses, norms
    _assert_same((record, {k: torch.from_numpy(v) for k, v in state.items()}), reference)


def test_dp2_equals_one_process(tmp_path: Path) -> None:
    _check_layout(tmp_path, tp=1, pp=1, dp=2, micro=1)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_pp2_equals_one_process(tmp_path: Path, schedule: str) -> None:
    _check_layout(tmp_path, tp=1, pp=2, dp=1, micro=2, schedule=schedule)


@pytest.mark.slow
def test_tp2_dp2_zero1_equals_one_process(tmp_path: Path) -> None:
    _check_layout(tmp_path, tp=2, pp=1, dp=2, micro=1, zero_stage=1)
