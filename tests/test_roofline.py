"""The dry run's roofline (`nanolight/pretrain/roofline.py`) prices what a GPU run pays: an
operator's bytes are what it reads and writes (a view or a device query moves nothing, an
in-place result is not a second write), and the CPU's flash attention counts the FLOPs torch's
own counter gives the same attention written as matmuls (and the scores again: flash's backward
recomputes them). The planner's table of those bytes per layer (`planner/timing.py`) is what
the roofline counts in the code's layer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from nanolight.models.llama_config import LlamaConfig, stage_costs
from nanolight.parallel.launcher import join_fake_world
from nanolight.planner.hardware import hardware
from nanolight.planner.layout import Layout
from nanolight.planner.memory import Workload
from nanolight.planner.timing import ELEMENTWISE_BYTES, elementwise_bytes, head_bytes
from nanolight.pretrain.auto import apply_layout
from nanolight.pretrain.config import ClusterConfig, PretrainConfig, TrainConfig
from nanolight.pretrain.dry_run import STEPS, measured_fit
from nanolight.pretrain.roofline import Roofline
from nanolight.pretrain.run import build_strategy

HW = hardware("h100-sxm")


def _measured(fn) -> Roofline:
    roofline = Roofline(HW)
    with roofline:
        fn()
    return roofline


def _bytes(roofline: Roofline) -> float:
    return sum(row[2] for row in roofline.ops[0].values())


def test_views_and_device_queries_move_nothing() -> None:
    x = torch.randn(64, 256)

    def views() -> None:
        x[:, :128].unsqueeze(0)
        x[:32].view(-1)
        x.t()
        # what `tensor.device` dispatches to under fake tensors (10,133 calls, 0.9 TB, in one
        # smollm-1.7b step once)
        assert torch.ops.prim.device.default(x).type == "cpu"
        torch.empty(1024, 1024)

    roofline = _measured(views)
    assert _bytes(roofline) == 0 and roofline.seconds[0] == 0.0


def test_each_tensor_is_read_or_written_once() -> None:
    a, b, c = (torch.randn(128, 128) for _ in range(3))
    size = a.numel() * a.element_size()
    cases = {
        "copy_": (lambda: c.copy_(a), 2),  # read a, write c
        "zero_": (lambda: c.zero_(), 1),  # write c
        "add_": (lambda: c.add_(a), 3),  # read c and a, write c
        "mul out=": (lambda: torch.mul(a, b, out=c), 3),  # read a and b, write c
        "add": (lambda: torch.add(a, b), 3),  # read a and b, write the result
    }
    for name, (fn, tensors) in cases.items():
        roofline = _measured(fn)
        assert _bytes(roofline) == tensors * size, name
        assert roofline.seconds[0] == tensors * size / HW.memory_bandwidth, name


def test_indexing_moves_the_addressed_elements_only() -> None:
    """A GPU's gather, in-place scatter-add and embedding read (and write) the elements or rows
    their index addresses, not the whole indexed tensor (the fused loss's (n, V) logits)."""
    logits, weight = torch.randn(64, 1000), torch.randn(1000, 32)
    index = torch.randint(0, 1000, (64, 1))
    ids, src = index[:, 0], torch.randn(64, 1)
    f, i = logits.element_size(), index.element_size()
    cases = {
        "gather": (lambda: logits.gather(1, index), 64 * i + 64 * f + 64 * f),  # index, read, out
        "scatter_add_": (lambda: logits.scatter_add_(1, index, src), 64 * i + 64 * f + 2 * 64 * f),
        "embedding": (lambda: F.embedding(ids, weight), 64 * i + 2 * 64 * 32 * f),  # rows read, out
    }
    for name, (fn, nbytes) in cases.items():
        assert _bytes(_measured(fn)) == nbytes, name


def test_bound_bytes_are_the_memory_bound_operators_only() -> None:
    """The planner prices matmuls by their FLOPs and the rest by `bound_bytes`: a matmul at a
    large size (compute-bound) is not in them, one at a tiny size (memory-bound) and an add are."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    size = a.numel() * a.element_size()
    roofline = _measured(lambda: (a @ b, a + b))
    assert roofline.flops[0] == 2 * 1024**3
    assert roofline.bound_bytes[0] == 3 * size  # the add's; the matmul's 3 * size are not
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    assert _measured(lambda: x @ y).bound_bytes[0] == 3 * x.numel() * x.element_size()


def test_table_seconds_price_matmuls_at_the_tables_rate_and_bytes_alike() -> None:
    """`seconds` is RuntimeEstimator's roofline (matmuls at the peak); `table_seconds` the same with
    matmuls at `Hardware.efficiency` of it: a compute-bound bf16 matmul takes 1/efficiency as long,
    a memory-bound add the same in both."""
    a, b = torch.randn(2048, 2048, dtype=torch.bfloat16), torch.randn(2048, 2048, dtype=torch.bfloat16)
    matmul, add = _measured(lambda: a @ b), _measured(lambda: a + b)
    hw = HW
    assert matmul.seconds[0] == pytest.approx(2 * 2048**3 / hw.bf16_flops)
    assert matmul.table_seconds[0] == pytest.approx(matmul.seconds[0] / hw.efficiency) and hw.efficiency < 1
    assert add.table_seconds[0] == add.seconds[0] == pytest.approx(3 * a.numel() * 2 / hw.memory_bandwidth)


def test_host_syncs_are_the_operators_that_read_a_value() -> None:
    """`.item()`, `bool()`, `float()` and a data-dependent shape (`nonzero`) each hand the host a
    value, where a GPU run waits; arithmetic does not."""
    x = torch.randn(8)
    reads = _measured(lambda: (x.sum().item(), bool(x.sum() > 0), float(x[0]), x.nonzero()))
    assert reads.host_syncs[0] == 4
    assert _measured(lambda: (x * 2 + x).sum()).host_syncs[0] == 0


def test_cpu_flash_attention_counts_the_attention_matmuls() -> None:
    q, k, v = (torch.randn(2, 4, 128, 32, requires_grad=True) for _ in range(3))

    def sdpa() -> None:
        F.scaled_dot_product_attention(q, k, v).sum().backward()

    def matmuls() -> None:
        scores = (q @ k.transpose(-1, -2) / 32**0.5).softmax(-1)
        (scores @ v).sum().backward()

    counter, recompute = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with counter:
        matmuls()
    with recompute:  # a flash kernel's backward computes the scores again
        q @ k.transpose(-1, -2)
    roofline = _measured(sdpa)
    assert any("flash_attention_for_cpu" in name for name in roofline.ops[0])
    assert roofline.flops[0] == counter.get_total_flops() + recompute.get_total_flops() > 0


def _elementwise_bytes(
    precision: str, layers: int, seq: int, micro_batches: int, tp: int = 1, rows: int = 1
) -> float:
    """Bytes of the operators the roofline prices by their bytes, in the second step of smollm-1.7b's
    real program cut to `layers` layers (one rank of 8, dp + ZeRO-1; tp > 1 with sequence
    parallelism, micro-batches of `rows` sequences) under fake tensors."""
    model = LlamaConfig.preset("smollm-1.7b", num_hidden_layers=layers)
    base = PretrainConfig(model=model, trainer=TrainConfig(seq_len=seq), cluster=ClusterConfig(gpus=8))
    layout = Layout(
        tp=tp,
        dp=8 // tp,
        zero_stage=1,
        sequence_parallel=tp > 1,
        micro_batch_size=rows,
        accumulate_grad_batches=micro_batches,
        precision=precision,
    )
    config = apply_layout(base, layout)
    join_fake_world(0, 8)
    try:
        strategy = build_strategy(config)
        strategy.setup_environment()
        with FakeTensorMode(allow_non_fake_inputs=True):
            _, _, roofline = measured_fit(config, strategy, HW, {})
    finally:
        dist.destroy_process_group()
    assert "aten._fused_adamw_.default" in roofline.ops[STEPS - 1]  # a CUDA rank's AdamW, not the CPU's
    return roofline.bound_bytes[STEPS - 1]


@pytest.mark.slow  # a dozen fake-tensor steps of a 2,048-wide model: about a minute on 2 shared cores
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-master"])
def test_the_planner_prices_the_layers_elementwise_bytes_the_dry_run_counts(precision: str) -> None:
    """`planner/timing.py`'s `ELEMENTWISE_BYTES` is what the code's layer moves besides its matmuls:
    a layer more, at two sequence lengths, gives the bytes per token; one micro-batch more, the
    bytes per weight (gradient accumulation, bf16-mixed's casts)."""
    short, long = 1024, 2048

    def layer(seq: int, micro_batches: int = 1) -> float:
        return _elementwise_bytes(precision, 2, seq, micro_batches) - _elementwise_bytes(
            precision, 1, seq, micro_batches
        )

    per_token = (layer(long) - layer(short)) / (long - short)
    per_weight = (layer(short, 2) - layer(short) - per_token * short) / stage_costs(
        LlamaConfig.preset("smollm-1.7b")
    )[0]
    work = Workload(LlamaConfig.preset("smollm-1.7b"), short, "cuda")
    lay = Layout(dp=8, zero_stage=1, precision=precision)
    weight = ELEMENTWISE_BYTES[precision, "none"][2]
    assert elementwise_bytes(work, lay) - weight * stage_costs(work.config)[0] == pytest.approx(
        per_token * short, rel=0.01
    )
    assert weight == pytest.approx(per_weight, rel=0.01)


@pytest.mark.slow  # a dozen fake-tensor steps of a 2,048-wide model: about a minute on 2 shared cores
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-master"])
def test_the_planner_prices_the_bytes_outside_the_layers_the_dry_run_counts(precision: str, tp: int) -> None:
    """`planner/timing.py`'s `head_bytes` is what the code moves outside its layers (embedding, final
    norm, fused head + loss) besides matmuls: one layer's model twice less the two-layer model's,
    per token from two sequence lengths (the CPU's loss chunks: the workload's device), per
    micro-batch from one more. At tp 2 (sp) the per-token and per-micro-batch bytes are held within
    1%: the table's per-hidden part is fitted from tp 1 and 2, so this holds the fit (the old table,
    all per vocabulary slice, priced tp 2 at 0.97-0.99 of the dry run)."""
    short, long = 1024, 2048

    def outside(seq: int, micro_batches: int = 1) -> float:
        return 2 * _elementwise_bytes(precision, 1, seq, micro_batches, tp=tp) - _elementwise_bytes(
            precision, 2, seq, micro_batches, tp=tp
        )

    model = LlamaConfig.preset("smollm-1.7b")
    lay = Layout(tp=tp, dp=8 // tp, zero_stage=1, sequence_parallel=tp > 1, precision=precision)
    planned = {seq: head_bytes(Workload(model, seq, "cpu"), lay) for seq in (short, long)}
    base = outside(short)
    assert planned[long] - planned[short] == pytest.approx(outside(long) - base, rel=0.01)
    assert planned[short] == pytest.approx(outside(short, 2) - base, rel=0.01)


@pytest.mark.slow  # eight fake-tensor steps of a 2,048-wide model: about a minute on 2 shared cores
def test_sequence_parallel_layers_move_what_the_planner_prices() -> None:
    """Under sequence parallelism every operator between the tp regions runs on 1/tp of the tokens
    and the collectives gather and scatter in place (`comm.token_chunk`): the dry run's tp 2 layer
    moves per token what the planner prices, a tp-1 layer's bytes over tp, within 5% (it measures
    0.96: sp also drops plain tp's copies before each all-reduce), and two rows of 1,024 tokens move
    what one of 2,048 does (a shard of each row's positions had copied the whole (B, T, H) around
    every collective: 20% more at two rows)."""
    short, long = 1024, 2048

    def layer(seq: int, rows: int = 1) -> float:
        return _elementwise_bytes("bf16-master", 2, seq, 1, tp=2, rows=rows) - _elementwise_bytes(
            "bf16-master", 1, seq, 1, tp=2, rows=rows
        )

    model, lay = (
        LlamaConfig.preset("smollm-1.7b"),
        Layout(tp=2, dp=4, sequence_parallel=True, precision="bf16-master"),
    )
    planned = {seq: elementwise_bytes(Workload(model, seq, "cuda"), lay) for seq in (short, long)}
    assert planned[long] - planned[short] == pytest.approx(layer(long) - layer(short), rel=0.05)
    assert layer(short, rows=2) == pytest.approx(layer(long), rel=0.005)
