"""Pipeline-parallel training matches the single-process model (gloo, CPU, fp32).

Each rank builds the plain reference model and, through `Parallel3DStrategy`, its pipeline
stage (optionally tp-sharded) from the same seed, runs the same 10 AdamW steps with gradient
clipping on both, and checks the loss at every step and the final weights (gathered by the
strategy into the single-device checkpoint format). A stand-in for the trainer's micro_step
records the order in which the engine calls it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.module import NanoModule
from nanolight.strategies.parallel3d import Parallel3DStrategy

STEPS, MICRO, B, T, SEED = 10, 4, 2, 16, 7


def tiny_config(tied: bool, layers: int = 4) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )


class Wrapper(NanoModule):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model: LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        self.model = LlamaForCausalLM(self.cfg)


class FakeMicroStep:
    """What the trainer's MicroStep does, minus hooks: forward (zero_grad after the first), backward."""

    def __init__(self, module: Wrapper, opt: torch.optim.Optimizer, strategy: Parallel3DStrategy) -> None:
        self.module, self.opt, self.strategy, self.calls = module, opt, strategy, []

    def __call__(self, batch: dict, i: int) -> torch.Tensor:
        loss = self.module.model(batch["input_ids"], labels=batch["labels"])
        self.calls.append(("F", i))
        if i == 0:
            self.strategy.zero_grad(self.opt)
        return loss

    def backward(self, loss: torch.Tensor, i: int) -> None:
        self.calls.append(("B", i))
        loss.backward()


def make_optimizer(params: object) -> torch.optim.Optimizer:
    """SGD with momentum: unlike Adam it does not blow a 1e-7 rounding difference in a near-zero
    gradient up to a full +-lr step, so final weights are comparable at 1e-5 (the trainer
    test covers AdamW)."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _batches(cfg: LlamaConfig) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (STEPS, MICRO, B, T), generator=gen)


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


def _pp_worker(
    rank: int, world: int, tp: int, pp: int, schedule: str, tied: bool, dp: int, zero: int, sp: bool
) -> dict:
    cfg = tiny_config(tied)
    strategy = Parallel3DStrategy(
        tp=tp, pp=pp, dp=dp, zero_stage=zero, pp_schedule=schedule, sequence_parallel=sp, init_seed=SEED
    )
    strategy.setup_environment()
    module = Wrapper(cfg)
    with strategy.model_init_context():
        module.configure_model()
    strategy.setup_module(module)
    ctx = strategy.parallel_context
    _check_stage_init(module, cfg, ctx, tp)
    (opt,) = strategy.setup_optimizers([make_optimizer(module.parameters())])  # maybe ZeRO-wrapped
    step_fn = FakeMicroStep(module, opt, strategy)
    losses, max_live = [], []
    for ids in _batches(cfg):
        micro_batches = [{"input_ids": x, "labels": x} for x in ids]
        loss = strategy.training_step(micro_batches, step_fn)
        strategy.clip_gradients(0.5)
        strategy.optimizer_step(opt)
        losses.append(loss.item())
        max_live.append(strategy._pipeline.engine.max_in_flight)
    state = strategy.model_state_dict()  # collective: gathers tp shards and pp stages
    tied_equal = None
    if tied and ctx.is_last_stage:
        lm = module.model
        tied_equal = lm.lm_head.weight is lm.model.embed_tokens.weight
    return {
        "losses": losses,
        "state": {k: v.numpy() for k, v in state.items()},  # numpy: pickled by value across processes
        "max_live": max(max_live),
        "calls": step_fn.calls[: 2 * MICRO],
        "pp_rank": ctx.pp_rank,
        "tied_same_param": tied_equal,
        "embed": module.model.model.embed_tokens.weight.detach().numpy().copy()
        if module.model.model.embed_tokens is not None
        else None,
        "metadata": strategy._pipeline.engine.stage.p2p.metadata_messages,
    }


def _check_stage_init(module: Wrapper, cfg: LlamaConfig, ctx: object, tp: int) -> None:
    """Only this stage's modules exist, and each parameter is exactly (its tp slice of) the
    single-device init: dropping other stages' layers did not shift the init stream."""
    from nanolight.parallel.tensor_parallel.apply import shard_dims, take_shard

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
    dims = shard_dims(lm)
    for name, p in lm.named_parameters():
        expected = take_shard(ref_params[name], dims[name], ctx.tp_group)
        assert torch.equal(p.detach(), expected), name


def _check(
    tp: int, pp: int, schedule: str, tied: bool, dp: int = 1, zero: int = 0, sp: bool = False
) -> list[dict]:
    cfg = tiny_config(tied)
    ref_losses, ref_state = reference_run(cfg)
    world = tp * pp * dp
    out = run_distributed(_pp_worker, world, tp, pp, schedule, tied, dp, zero, sp, timeout=240, pg_timeout=60)
    for r in out:  # every rank returns the true loss of every step
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    state = out[0]["state"]
    assert list(state) == list(ref_state), "checkpoint keys/order differ from the single-device model"
    for name, ref in ref_state.items():
        got = torch.from_numpy(state[name])
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, name  # the tensor as a whole
        # element-wise: atol for entries near zero (summation order differs across stages)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    for r in out:  # each forward is called exactly once per micro-batch, in schedule order
        assert sorted(i for k, i in r["calls"] if k == "F") == list(range(MICRO))
        assert r["metadata"] <= 1 + (r["pp_rank"] not in (0, pp - 1))  # one handshake per channel
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


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("schedule", ["1f1b", "afab"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (1, 4), (2, 2)], ids=["pp2", "pp4", "pp2xtp2"])
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
    out = _pp_worker_min(schedule)
    return out


def _pp_worker_min(schedule: str) -> tuple[int, int]:
    cfg = tiny_config(tied=False)
    strategy = Parallel3DStrategy(pp=dist.get_world_size(), pp_schedule=schedule, init_seed=SEED)
    strategy.setup_environment()
    module = Wrapper(cfg)
    with strategy.model_init_context():
        module.configure_model()
    strategy.setup_module(module)
    (opt,) = strategy.setup_optimizers([torch.optim.SGD(module.parameters(), lr=0.0)])
    ids = _batches(cfg)[0].repeat(2, 1, 1)  # 8 micro-batches
    strategy.training_step([{"input_ids": x, "labels": x} for x in ids], FakeMicroStep(module, opt, strategy))
    return strategy._pipeline.engine.max_in_flight, strategy.parallel_context.pp_rank


@pytest.mark.parametrize("schedule", ["1f1b", "afab"])
def test_live_activations(schedule: str) -> None:
    """1F1B keeps at most pp micro-batches' activations on stage 0; all-forward-all-backward all m."""
    out = run_distributed(_memory_worker, 4, schedule, timeout=120)
    live = {stage: n for n, stage in out}
    if schedule == "1f1b":
        assert live == {0: 4, 1: 3, 2: 2, 3: 1}
    else:
        assert all(n == 2 * MICRO for n in live.values())
