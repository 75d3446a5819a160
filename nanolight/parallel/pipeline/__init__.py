"""Pipeline parallelism: split by module name (`split.py`), schedules as data (`schedules.py`),
point-to-point exchange (`p2p.py`), a rank's chunks and their schedule (`runner.py`) and its stage (`stage.py`)."""

from nanolight.parallel.pipeline.p2p import StageP2P
from nanolight.parallel.pipeline.runner import StageChunks
from nanolight.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    all_forward_all_backward,
    bubble_fraction,
    check_micro_batches,
    interleaved_1f1b,
    max_in_flight,
    one_by_one,
    one_forward_one_backward,
    stage_schedule,
)
from nanolight.parallel.pipeline.split import (
    PipelineSplit,
    StageLayers,
    apply_split,
    balanced_layer_split,
    check_pipeline_layout,
    plan_split,
)
from nanolight.parallel.pipeline.stage import PipelineStage

__all__ = [
    "BACKWARD",
    "FORWARD",
    "PipelineSplit",
    "PipelineStage",
    "StageChunks",
    "StageLayers",
    "StageP2P",
    "all_forward_all_backward",
    "apply_split",
    "balanced_layer_split",
    "bubble_fraction",
    "check_micro_batches",
    "check_pipeline_layout",
    "interleaved_1f1b",
    "max_in_flight",
    "one_by_one",
    "one_forward_one_backward",
    "plan_split",
    "stage_schedule",
]
