"""Pipeline-parallel training matches the single-process model (gloo, CPU, fp32).

Each rank builds, through `Parallel3DStrategy`, its pipeline stage (optionally tp-sharded) from the
same seed as a plain reference model, runs the same 10 SGD steps with gradient clipping through
NanoTrainer (which walks the strategy's schedule), and checks the loss at every step, the stage's
initial weights, and the final weights (read back from the run's per-rank checkpoint shards).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _tiny import run_distributed, tiny_config
from torch.utils.data import DataLoader

from nanolight import Callback, NanoModule, NanoTrainer
from nanolight.checkpoint import CheckpointReader
from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.parallel.tensor_parallel import shard_chunks, shard_dims, take_shard
from nanolight.strategies.parallel3d import Parallel3DStrategy

STEPS, MICRO, B, T, SEED = 10, 4, 2, 16, 7


def pp_config(tied: bool, layers: int = 4) -> LlamaConfig:
    return tiny_config(vocab=256, layers=layers, tied=tied)


class Wrapper(NanoModule):
    def __init__(self, cfg: LlamaConfig, lr: float = 0.5) -> None:
        super().__init__()
        self.cfg, self.lr = cfg, lr
        self.model: LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        self.model = LlamaForCausalLM(self.cfg)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(batch["input_ids"], labels=batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters(), self.lr)


def make_optimizer(params: object, lr: float = 0.5) -> torch.optim.Optimizer:
    """SGD with momentum: unlike Adam it does not blow a 1e-7 rounding difference in a near-zero
    gradient up to a full +-lr step, so final weights are comparable at 1e-5 (the trainer
    test covers AdamW)."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _batches(cfg: LlamaConfig, steps: int = STEPS, micro: int = MICRO) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (steps, micro, B, T), generator=gen)


def _loader(cfg: LlamaConfig, steps: int = STEPS, micro: int = MICRO) -> DataLoader:
    rows = _batches(cfg, steps, micro).reshape(-1, T)
    return DataLoader([{"input_ids": x, "labels": x} for x in rows], batch_size=B)


def reference_run(cfg: LlamaConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process run: same init, data, accumulation, clipping and optimizer."""
    ref = LlamaForCausalLM(cfg)
    ref.init_weights(torch.Generator().manual_seed(SEED))
    opt = make_optimizer(ref.parameters())
    losses = []
    for ids in _batches(cfg):
        opt.zero_grad(set_to_none=True)
        step = [ref(x, labels=x) for x in ids]
        for loss in step:
            (loss / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        losses.append(torch.stack([x.detach() for x in step]).mean().item())
    return losses, {f"model.{k}": v.detach() for k, v in ref.state_dict().items()}


class Observe(Callback):
    """What the test checks on every rank: the stage's initial weights, each step's loss, the
    forwards' order, the live micro-batches and the p2p metadata handshakes."""

    def __init__(self, cfg: LlamaConfig) -> None:
        self.cfg, self.losses, self.forwards, self.max_live, self.init_ok = cfg, [], [], 0, False

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.init_ok = _check_stage_init(pl_module, self.cfg, trainer.strategy.parallel.context)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == 0:
            self.forwards.append(batch_idx)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self.losses.append(float(trainer.step_loss))
        self.max_live = max(self.max_live, trainer.strategy.stage.max_in_flight)


def _pp_worker(
    rank: int,
    world: int,
    tp: int,
    pp: int,
    schedule: str,
    tied: bool,
    dp: int,
    zero: int,
    sp: bool,
    root: str,
    virtual: int,
    layers: int,
) -> dict:
    cfg = pp_config(tied, layers)
    strategy = Parallel3DStrategy(
        tp=tp, pp=pp, dp=dp, zero_stage=zero, pp_schedule=schedule, sequence_parallel=sp, init_seed=SEED,
        pp_virtual=virtual,
    )  # fmt: skip
    seen = Observe(cfg)
    trainer = NanoTrainer(
        use_distributed_sampler=False,  # each rank is given its own data
        max_steps=STEPS, accumulate_grad_batches=MICRO, gradient_clip_val=0.5, strategy=strategy, logger=False,
        callbacks=[seen], enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    module = Wrapper(cfg)
    trainer.fit(module, train_dataloaders=_loader(cfg))  # every dp replica: the same micro-batches
    trainer.save_checkpoint(Path(root) / "ckpt", update_last=False)  # collective
    state = None
    if rank == 0:
        state = {k: v.numpy() for k, v in CheckpointReader.open(Path(root) / "ckpt").model_state().items()}
    ctx, lm = strategy.parallel.context, module.model
    return {
        "losses": seen.losses,
        "init_ok": seen.init_ok,
        "state": state,  # numpy: pickled by value across processes
        "max_live": seen.max_live,
        "forwards": seen.forwards,
        "pp_rank": ctx.pp_rank,
        "tied_same_param": tied and ctx.is_last_stage and lm.lm_head.weight is lm.model.embed_tokens.weight,
        "embed": lm.model.embed_tokens.weight.detach().numpy().copy()
        if lm.model.embed_tokens is not None
        else None,
        "metadata": strategy.stage.p2p.metadata_messages,
    }


def _check_stage_init(module: Wrapper, cfg: LlamaConfig, ctx: object) -> bool:
    """Only this stage's modules exist, and each parameter is exactly (its tp slice of) the
    single-device init: dropping other stages' layers did not shift the init stream."""
    ref = LlamaForCausalLM(cfg)
    ref.init_weights(torch.Generator().manual_seed(SEED))
    ref_params = dict(ref.named_parameters())
    lm = module.model
    layers = {
        int(name.split(".")[2]) for name, _ in lm.named_parameters() if name.startswith("model.layers.")
    }
    assert len(layers) < cfg.num_hidden_layers  # never built: the other stages' layers
    assert (lm.model.embed_tokens is not None) == (
        ctx.is_first_stage or (cfg.tie_word_embeddings and ctx.is_last_stage)
    )
    assert (lm.lm_head is not None) == ctx.is_last_stage
    dims, chunks = shard_dims(lm), shard_chunks(lm)
    for name, p in lm.named_parameters():
        expected = take_shard(ref_params[name], dims[name], ctx.tp_group, chunks.get(name, 1))
        assert torch.equal(p.detach(), expected), name
    return True


def _check(
    tp: int,
    pp: int,
    schedule: str,
    tied: bool,
    dp: int = 1,
    zero: int = 0,
    sp: bool = False,
    virtual: int = 1,
    layers: int = 4,
) -> list[dict]:
    import tempfile

    cfg = pp_config(tied, layers)
    ref_losses, ref_state = reference_run(cfg)
    world = tp * pp * dp
    with tempfile.TemporaryDirectory() as root:
        out = run_distributed(
            _pp_worker, world, tp, pp, schedule, tied, dp, zero, sp, root, virtual, layers, timeout=240,
            pg_timeout=60,
        )  # fmt: skip
    assert all(r["init_ok"] for r in out)
    for r in out:  # every rank sees the true loss of every step
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    state = out[0]["state"]
    assert sorted(state) == sorted(ref_state), "checkpoint keys differ from the single-device model"
    for name, ref in ref_state.items():
        got = torch.from_numpy(state[name])
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, name  # the tensor as a whole
        # element-wise: atol for entries near zero (summation order differs across stages; the tied
        # embedding adds the first and last stage's gradients in another order, and Adam turns a
        # last-bit difference of a near-zero gradient into up to ~3.5e-6 on a few of its entries)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=5e-6, msg=lambda m, name=name: f"{name}: {m}")
    for r in out:  # each forward is called exactly once per micro-batch
        assert sorted(r["forwards"]) == list(range(MICRO))
        # one handshake per channel and virtual stage boundary: v sends and v receives per rank
        # (virtual stage 0 receives nothing, the last one sends nothing)
        assert r["metadata"] <= 2 * virtual - (r["pp_rank"] in (0, pp - 1))
    if tied:  # the two copies of the tied embedding stayed identical
        first = [r for r in out if r["pp_rank"] == 0]
        last = [r for r in out if r["pp_rank"] == pp - 1]
        for a, b in zip(first, last, strict=True):
            assert b["tied_same_param"]
            assert (a["embed"] == b["embed"]).all()
    return out


def test_pp2_1f1b_tied_matches_single_process() -> None:
    out = _check(tp=1, pp=2, schedule="1f1b", tied=True)
    assert out[0]["max_live"] <= 2  # 1F1B: at most pp micro-batches in flight on stage 0


# (tp, pp, schedule, tied); pp2-1f1b-tied is test_pp2_1f1b_tied_matches_single_process, in the default suite
PP_MATRIX = {
    f"{name}-{schedule}-{'tied' if tied else 'untied'}": (tp, pp, schedule, tied)
    for name, tp, pp in (("pp2", 1, 2), ("pp4", 1, 4), ("pp2xtp2", 2, 2))
    for schedule in ("1f1b", "afab")
    for tied in (True, False)
    if (name, schedule, tied) != ("pp2", "1f1b", True)
}


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "schedule", "tied"), PP_MATRIX.values(), ids=PP_MATRIX.keys())
def test_pp_matrix(tp: int, pp: int, schedule: str, tied: bool) -> None:
    out = _check(tp, pp, schedule, tied)
    first_stage_live = out[0]["max_live"]
    assert first_stage_live <= pp if schedule == "1f1b" else first_stage_live == MICRO


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1], ids=["dp", "zero1"])
def test_pp2_with_dp2_matches_single_process(zero: int) -> None:
    """Every dp replica gets the same micro-batches here, so the dp mean equals one replica."""
    _check(tp=1, pp=2, schedule="1f1b", tied=True, dp=2, zero=zero)


@pytest.mark.slow
def test_pp2_tp2_sequence_parallel_matches_single_process() -> None:
    """With sequence parallelism the activations crossing stages are (B, T/tp, C) shards."""
    _check(tp=2, pp=2, schedule="1f1b", tied=True, sp=True)


def _memory_worker(rank: int, world: int, schedule: str) -> tuple[int, int]:
    cfg = pp_config(tied=False)
    strategy = Parallel3DStrategy(pp=world, pp_schedule=schedule, init_seed=SEED)
    seen = Observe(cfg)
    trainer = NanoTrainer(
        use_distributed_sampler=False,  # each rank is given its own data
        max_steps=1, accumulate_grad_batches=2 * MICRO, strategy=strategy, logger=False, callbacks=[seen],
        enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(Wrapper(cfg, lr=0.0), train_dataloaders=_loader(cfg, steps=1, micro=2 * MICRO))
    return seen.max_live, strategy.parallel.context.pp_rank


@pytest.mark.parametrize("schedule", ["1f1b", "afab"])
def test_live_activations(schedule: str) -> None:
    """1F1B keeps at most pp micro-batches' activations on stage 0; all-forward-all-backward all m."""
    out = run_distributed(_memory_worker, 4, schedule, timeout=120)
    live = {stage: n for n, stage in out}
    if schedule == "1f1b":
        assert live == {0: 4, 1: 3, 2: 2, 3: 1}
    else:
        assert all(n == 2 * MICRO for n in live.values())
