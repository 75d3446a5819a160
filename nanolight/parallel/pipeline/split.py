"""Cut a model into pipeline stages by module name: which stage holds what, as a record.

The model declares its pipeline plan as data (`LlamaForCausalLM.pp_plan`), as it declares its
tensor-parallel plan; nothing here knows Llama:

    "first":  modules only the first stage runs           (the embedding)
    "layers": the repeated blocks, split into contiguous runs, one run per virtual stage
    "last":   modules only the last stage runs            (final norm, output head)

With v virtual stages per rank (interleaved 1F1B) the blocks are cut into p*v runs ("chunks");
chunk g is virtual stage g and lives on rank g mod p, so rank r holds the v non-adjacent runs
r, r+p, r+2p, ... (`PipelineSplit.chunks`); the first modules go with chunk 0 (rank 0), the
last with chunk p*v-1 (rank p-1). `runner.py` (`StageChunks`) runs one chunk at a time.

A "first" module whose parameter is tied to a "last" module's (the embedding that *is*
``lm_head.weight``) is kept on the last stage too: it costs no memory there and keeps the
parameter's name. Dropped modules become None (`nn.Module` then skips them in
`named_parameters` and `state_dict`, and the model's forward skips them); the blocks become a
`StageLayers` dict keyed by their global index, so a kept layer is still ``model.layers.5`` and
checkpoints load at any layout. Splitting runs on the meta device, before materialisation, so
a rank never allocates other stages' weights.

Layers are balanced by cost (`balanced_layer_split`, costs from the model's
``pipeline_costs()``, which lives with its FLOPs); `layers_per_stage` overrides the balance.
`PipelineSplit.holders` answers "which stages hold this tensor" for every rank without any
communication: the record is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import nn

from nanolight.errors import UsageError


class StageLayers(nn.ModuleDict):
    """The blocks one stage owns, keyed by their global index ("5" -> model.layers.5).

    Iterating yields the layers (like the `nn.ModuleList` it replaces), in index order."""

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


def check_pipeline_layout(pp: int, num_layers: int, virtual: int = 1) -> None:
    """Raise ValueError with a fix-it message if the model cannot be cut into `pp` stages (of
    `virtual` chunks each)."""
    if pp > num_layers:
        raise UsageError(
            f"pipeline parallelism pp={pp} is larger than the model's num_hidden_layers={num_layers}: "
            f"every stage needs at least one decoder layer; choose pp <= {num_layers}"
        )
    if pp * virtual > num_layers:
        raise UsageError(
            f"pp={pp} stages of pp_virtual={virtual} chunks need pp*pp_virtual = {pp * virtual} decoder "
            f"layers, but the model has num_hidden_layers={num_layers}: every virtual stage needs at "
            f"least one; choose pp_virtual <= {num_layers // pp}"
        )


def balanced_layer_split(
    num_layers: int,
    pp: int,
    layer_cost: float = 1.0,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
    layers_per_stage: Sequence[int] | None = None,
) -> list[range]:
    """Contiguous layer ranges per stage minimising the costliest stage (the pipeline's pace).

    `first_extra` / `last_extra` are the first / last stage's extra modules' costs in units of
    `layer_cost`. Exact dynamic programme over split points: O(pp * L^2), trivial for L <= 1000.
    """
    check_pipeline_layout(pp, num_layers)
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            raise UsageError(
                f"layers_per_stage={counts} must list {pp} positive layer counts summing to "
                f"num_hidden_layers={num_layers}"
            )
    else:
        counts = _min_max_partition(num_layers, pp, layer_cost, first_extra, last_extra)
    starts = [sum(counts[:s]) for s in range(pp)]
    return [range(a, a + n) for a, n in zip(starts, counts, strict=True)]


def _min_max_partition(L: int, pp: int, cost: float, first: float, last: float) -> list[int]:
    """Layer counts per stage (each >= 1) minimising the max stage cost; ties favour earlier
    stages holding fewer layers (they also hold more in-flight activations under 1F1B)."""

    def stage_cost(s: int, n: int) -> float:
        return n * cost + (first if s == 0 else 0.0) + (last if s == pp - 1 else 0.0)

    # best[s][k]: (max cost, counts) placing the first k layers on stages 0..s
    best: list[dict[int, tuple[float, list[int]]]] = [{} for _ in range(pp)]
    for k in range(1, L - pp + 2):
        best[0][k] = (stage_cost(0, k), [k])
    for s in range(1, pp):
        for k in range(s + 1, L - (pp - 1 - s) + 1):
            options = []
            for n in range(1, k - s + 1):
                prev_cost, prev_counts = best[s - 1][k - n]
                options.append((max(prev_cost, stage_cost(s, n)), -n, prev_counts + [n]))
            c, _, counts = min(options, key=lambda o: (o[0], o[1]))
            best[s][k] = (c, counts)
    return best[pp - 1][L][1]


@dataclass(frozen=True)
class PipelineSplit:
    """Which stage holds which module of a model cut by its ``pp_plan`` (the same on every rank)."""

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    ranges: tuple[range, ...]  # layers of each virtual stage (chunk): p*v contiguous runs
    shared: frozenset[str]  # "first" modules the last stage keeps too (tied to a "last" module)
    virtual: int = 1  # chunks per rank

    @property
    def pp_size(self) -> int:
        return len(self.ranges) // self.virtual

    def chunks(self, stage: int) -> list[int]:
        """The virtual stages (global chunk indices) rank `stage` holds, in order: stage, stage+p, ..."""
        return list(range(stage, len(self.ranges), self.pp_size))

    def holders(self, key: str) -> tuple[int, ...]:
        """The stages holding parameter/state-dict key `key` (a name inside the split model)."""
        last = self.pp_size - 1
        if key.startswith(self.layers + "."):
            index = int(key[len(self.layers) + 1 :].split(".", 1)[0])
            return tuple(g % self.pp_size for g, r in enumerate(self.ranges) if index in r)
        if _under(key, self.first):
            return (0, last) if _under(key, tuple(self.shared)) and last > 0 else (0,)
        if _under(key, self.last):
            return (last,)
        return tuple(range(self.pp_size))  # not in the plan: every stage holds its own copy

    def keeps(self, stage: int, module: str) -> bool:
        if module in self.first:
            return stage == 0 or (module in self.shared and stage == self.pp_size - 1)
        return module not in self.last or stage == self.pp_size - 1


def _under(key: str, modules: tuple[str, ...]) -> bool:
    return any(key == m or key.startswith(m + ".") for m in modules)


def plan_split(
    model: nn.Module, pp: int, layers_per_stage: Sequence[int] | None = None, virtual: int = 1
) -> PipelineSplit:
    """The split of `model` (declaring ``pp_plan``) into `pp` stages of `virtual` chunks each,
    balanced by its costs; `layers_per_stage` lists the layers of each of the pp*virtual chunks."""
    plan = getattr(model, "pp_plan", None)
    if not isinstance(plan, dict):
        raise TypeError(f"{type(model).__name__} declares no `pp_plan`; pipeline parallelism needs one")
    first, last = tuple(plan.get("first", ())), tuple(plan.get("last", ()))
    num_layers = len(model.get_submodule(plan["layers"]))
    check_pipeline_layout(pp, num_layers, virtual)
    costs = model.pipeline_costs() if hasattr(model, "pipeline_costs") else (1.0, 0.0, 0.0)
    ranges = balanced_layer_split(num_layers, pp * virtual, *costs, layers_per_stage=layers_per_stage)
    tied = _tied_keys(model)
    shared = frozenset(m for m in first if any(_under(a, (m,)) and _under(b, last) for a, b in tied))
    return PipelineSplit(first, plan["layers"], last, tuple(ranges), shared, virtual)


def _tied_keys(model: nn.Module) -> list[tuple[str, str]]:
    """(key, alias) pairs of state-dict entries that are one tensor (lm_head tied to the embedding)."""
    first: dict[int, str] = {}
    pairs = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            pairs.append((first[id(tensor)], key))
        else:
            first[id(tensor)] = key
    return pairs


def apply_split(model: nn.Module, split: PipelineSplit, stage: int) -> None:
    """Drop from `model` (ideally on meta) every module that `stage` does not hold."""
    blocks = model.get_submodule(split.layers)
    held = sorted(i for g in split.chunks(stage) for i in split.ranges[g])
    model.set_submodule(split.layers, StageLayers({str(i): blocks[i] for i in held}))
    for name in split.first + split.last:
        if not split.keeps(stage, name):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, None)
