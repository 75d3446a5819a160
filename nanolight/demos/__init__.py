"""``lightning.pytorch.demos`` ported: the boring classes bug reports and tests start from
(`boring_classes.py`). Lightning's MNIST / WikiText-2 demos download their data and are not here."""

from nanolight.demos.boring_classes import (
    BoringDataModule,
    BoringDataModuleNoLen,
    BoringModel,
    DemoModel,
    ManualOptimBoringModel,
    RandomDataset,
    RandomDictDataset,
    RandomIterableDataset,
    RandomIterableDatasetWithLen,
)

__all__ = [
    "BoringDataModule",
    "BoringDataModuleNoLen",
    "BoringModel",
    "DemoModel",
    "ManualOptimBoringModel",
    "RandomDataset",
    "RandomDictDataset",
    "RandomIterableDataset",
    "RandomIterableDatasetWithLen",
]
