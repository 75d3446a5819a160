"""The 3D-parallel core: process groups (`ParallelContext`), tensor parallelism
(`tensor_parallel/`), pipeline parallelism (`pipeline/`, its messages through `p2p.py`), data
parallelism (`data_parallel.py`) and the ZeRO-1 optimizer (`zero.py`). Usable without the trainer;
imports nothing from it."""

from nanolight.parallel.config import ParallelConfig
from nanolight.parallel.context import ParallelContext

__all__ = ["ParallelConfig", "ParallelContext"]
