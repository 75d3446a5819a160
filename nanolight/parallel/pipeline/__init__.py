"""Pipeline parallelism: stage split by module name, P2P, schedules (all-fwd-all-bwd, 1F1B)."""

from nanolight.parallel.pipeline.engine import PipelineEngine
from nanolight.parallel.pipeline.p2p import StageP2P
from nanolight.parallel.pipeline.schedules import (
    all_forward_all_backward,
    bubble_fraction,
    build_schedule,
    max_in_flight,
    one_forward_one_backward,
)
from nanolight.parallel.pipeline.split import (
    StageLayers,
    balanced_layer_split,
    check_micro_batches,
    check_pipeline_layout,
    init_stage_,
    llama_stage_costs,
    param_specs,
    split_causal_lm,
    tie_stage_weights,
)
from nanolight.parallel.pipeline.stage import PipelineStage

__all__ = [
    "PipelineEngine",
    "PipelineStage",
    "StageLayers",
    "StageP2P",
    "all_forward_all_backward",
    "balanced_layer_split",
    "bubble_fraction",
    "build_schedule",
    "check_micro_batches",
    "check_pipeline_layout",
    "init_stage_",
    "llama_stage_costs",
    "max_in_flight",
    "one_forward_one_backward",
    "param_specs",
    "split_causal_lm",
    "tie_stage_weights",
]
