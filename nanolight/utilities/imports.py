"""The availability flags Lightning's examples and docs import from
``lightning.pytorch.utilities.imports`` (each true when the package is installed, at the version)."""

from __future__ import annotations

import operator
import sys

from lightning_utilities.core.imports import RequirementCache, compare_version, package_available

_PYTHON_GREATER_EQUAL_3_11_0 = sys.version_info[:2] >= (3, 11)
_TORCH_GREATER_EQUAL_2_6 = compare_version("torch", operator.ge, "2.6.0")
_TORCH_GREATER_EQUAL_2_8 = compare_version("torch", operator.ge, "2.8.0")
_TORCHMETRICS_GREATER_EQUAL_0_8_0 = RequirementCache("torchmetrics>=0.8.0")
_TORCHMETRICS_GREATER_EQUAL_0_9_1 = RequirementCache("torchmetrics>=0.9.1")
_TORCHMETRICS_GREATER_EQUAL_0_11 = RequirementCache("torchmetrics>=0.11.0")
_TORCHMETRICS_GREATER_EQUAL_1_0_0 = RequirementCache("torchmetrics>=1.0.0")
_OMEGACONF_AVAILABLE = package_available("omegaconf")
_TORCHVISION_AVAILABLE = RequirementCache("torchvision")
_RICH_AVAILABLE = RequirementCache("rich>=10.2.2")
_WANDB_AVAILABLE = RequirementCache("wandb")
