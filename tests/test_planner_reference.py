"""The planner's model-state and activation formulas next to the published estimators.

Model states (parameters + gradients + optimizer state per rank), three published Llama shapes:

    model (published config)          layout              Megatron (18 or 6+12/dp B/param)  DeepSpeed ZeRO-2 (4 + 16/N)
    Llama-2-7B  (h4096 L32 ffn11008)  dp8                 18 B/param: equal               5.75 vs 6.00 B/param (-4.2%)
    Llama-3-8B  (GQA 8, vocab 128256) tp2 dp32, dist.opt  6.50 vs 6.375 B/param (+2.0%)   -
    SmolLM2-1.7B (tied, vocab 49152)  dp64, dist.opt      6.25 vs 6.1875 B/param (+1.0%)  4.22 vs 4.25 B/param (-0.7%)

Megatron-LM's `theoretical_memory_usage.compute_weight_and_optimizer_memory` (the version with
`gated_linear_multiplier`) counts the same parameters (its SwiGLU MLP is 3*h*ffn) and charges 18
bytes per parameter (bf16 weight, fp32 gradient, fp32 master + two moments): nanolight's
`bf16-master`. With its distributed optimizer, 6 + 12/dp: nanolight's ZeRO-1 keeps 4/dp more, the
reduce-scattered fp32 gradient shard it steps from (`ZeroOptimizer.shard_grads`), where Megatron
reduce-scatters inside its gradient buffer. Megatron also splits the norm weights over tp (we
replicate them: 2h per layer, negligible).

DeepSpeed's `estimate_zero2_model_states_mem_needs` (no offload) charges 4P + 16P/N: fp16/bf16
weights and gradients, and per rank 1/N of fp32 master, moments and an fp32 gradient partition.
nanolight's `bf16-true` + ZeRO-1 is that recipe with a bf16 gradient shard: 4 + 14/dp.

Activations, against Korthikanti et al. 2022 (Table 2; Megatron's `compute_activation_memory`):
per block with sequence parallelism, 16-bit activations, s*b*h units:
- full recompute: theirs 2/tp (the block input), ours the same: 2/tp.
- selective: theirs (18 + 4*ffn/h)/tp (GeLU MLP and dropout masks kept, the attention core
  recomputed). Ours (`recompute._keep`) keeps the block input (2), the matmul outputs -- qkv
  (2(q+2kv)/h = 6 for MHA), gate_up (4*ffn/h) -- and the attention kernel's output (2) and fp32
  log-sum-exp, all /tp; but also the two row-parallel matmul outputs (o, down: 2 each) before
  their reduce-scatter, which tp does not split. For Llama-2-7B at tp=8 that is
  (2 + 6 + 2 + 4*2.6875)/8 + 4 = 6.59 s*b*h against their 3.59: the unsplit row-parallel outputs
  dominate at large tp (keeping the reduce-scattered shard instead would save 4(1 - 1/tp)).
"""

from __future__ import annotations

import pytest

from nanolight.models.llama_config import LlamaConfig
from nanolight.planner.layout import Layout
from nanolight.planner.memory import Workload, block_activation_bytes, rank_memory

LLAMA = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32}
LLAMA2_7B = LlamaConfig(
    vocab_size=32000, intermediate_size=11008, num_key_value_heads=32, max_position_embeddings=4096, **LLAMA
)
LLAMA3_8B = LlamaConfig(
    vocab_size=128256, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=8192, **LLAMA
)
SMOLLM2_1_7B = LlamaConfig.preset("smollm-1.7b")


def megatron_weight_and_optimizer(c: LlamaConfig, tp: int, pp: int, dp: int, distributed: bool) -> float:
    """Megatron-LM's formula (megatron/training/theoretical_memory_usage.py), SwiGLU, no MoE."""
    h, L = c.hidden_size, c.num_hidden_layers
    per_h2 = (
        (1 + c.num_key_value_heads / c.num_attention_heads) * (c.head_dim * c.num_attention_heads / h)
        + (c.intermediate_size / h) * 1.5
        + 2 / h
        + 1 / (L * h)
    )
    transformer = 2 * L * h * h * per_h2
    embedding = h * c.vocab_size
    shard = (transformer / pp + embedding) / tp
    if not c.tie_word_embeddings and pp == 1:
        shard += embedding / tp
    return shard * (18 if not distributed else 6 + 12 / dp)


def deepspeed_zero2(c: LlamaConfig, gpus: int, params: int) -> float:
    """DeepSpeed's estimate_zero2_model_states_mem_needs, cpu_offload=False."""
    return 4 * params + int(16 * params / gpus)


def _states(c: LlamaConfig, layout: Layout) -> int:
    parts = rank_memory(Workload(c, 2048), layout, 0)
    return parts["parameters"] + parts["gradients"] + parts["optimizer_state"]


@pytest.mark.parametrize(
    ("config", "tp", "dp", "zero", "expected"),
    [(LLAMA2_7B, 1, 8, 0, 0.0), (LLAMA3_8B, 2, 32, 1, 0.020), (SMOLLM2_1_7B, 1, 64, 1, 0.010)],
)
def test_model_states_agree_with_megatron(
    config: LlamaConfig, tp: int, dp: int, zero: int, expected: float
) -> None:
    ours = _states(config, Layout(tp=tp, dp=dp, zero_stage=zero, precision="bf16-master"))
    theirs = megatron_weight_and_optimizer(config, tp, 1, dp, distributed=bool(zero))
    assert ours / theirs - 1 == pytest.approx(expected, abs=0.002)  # the docstring's figures
    assert abs(ours / theirs - 1) < 0.05


@pytest.mark.parametrize(("config", "dp", "expected"), [(LLAMA2_7B, 8, -0.042), (SMOLLM2_1_7B, 64, -0.007)])
def test_model_states_agree_with_deepspeed(config: LlamaConfig, dp: int, expected: float) -> None:
    ours = _states(config, Layout(dp=dp, zero_stage=1, precision="bf16-true"))
    params = rank_memory(Workload(config, 2048), Layout(dp=dp), 0)["parameters"] // 4
    theirs = deepspeed_zero2(config, dp, params)
    assert ours / theirs - 1 == pytest.approx(expected, abs=0.002)
    assert abs(ours / theirs - 1) < 0.05


def test_activations_next_to_korthikanti() -> None:
    c, tp, s, b = LLAMA2_7B, 8, 4096, 1
    work = Workload(c, s)
    sbh = s * b * c.hidden_size
    lay = Layout(tp=tp, sequence_parallel=True, micro_batch_size=b, precision="bf16-true")
    full = block_activation_bytes(work, Layout(**{**lay.as_dict(), "activation_checkpointing": "full"}))
    assert full == 2 * sbh / tp  # Korthikanti's full recompute: the block input, sharded by sp
    ours = block_activation_bytes(work, Layout(**{**lay.as_dict(), "activation_checkpointing": "selective"}))
    theirs = sbh * (18 + 4 * c.intermediate_size / c.hidden_size) / tp
    lse = 4 * b * (c.num_attention_heads // tp) * s  # fp32 log-sum-exp of the attention kernel
    explained = sbh * ((2 + 6 + 2 + 4 * c.intermediate_size / c.hidden_size) / tp + 4) + lse
    assert ours == pytest.approx(explained)  # the docstring's decomposition
    assert ours / theirs == pytest.approx(6.59 / 3.59, rel=0.01)
