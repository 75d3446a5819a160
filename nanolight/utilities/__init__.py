"""Lightning's ``lightning.pytorch.utilities`` names a program imports: the rank-zero helpers (from
lightning-utilities, whose ``rank_zero_only.rank`` the strategy sets), ``is_overridden``, the
hook-signature check, the ``imports`` flags and ``AttributeDict`` (what ``self.hparams`` is). Only what nanolight itself has a use for or a
ported program needs; nothing here imports the trainer at import time."""

from typing import Any

from nanolight.errors import missing_name
from nanolight.module.hparams import AttributeDict
from nanolight.utilities.grads import grad_norm
from nanolight.utilities.model_helpers import is_overridden
from nanolight.utilities.rank_zero import (
    rank_zero_debug,
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)
from nanolight.utilities.signature_utils import is_param_in_hook_signature
from nanolight.utilities.throughput import measure_flops

__all__ = [
    "AttributeDict",
    "grad_norm",
    "is_overridden",
    "is_param_in_hook_signature",
    "measure_flops",
    "rank_zero_debug",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
]


def __getattr__(name: str) -> Any:
    """Lightning's names nanolight lacks fail with what to use instead (`errors.LIGHTNING_ONLY`)."""
    raise missing_name(__name__, name)
