"""The errors nanolight raises on purpose: what is wrong and how to fix it, in one message.

Entry points (the recipe) print them as one line, ``nanolight: error: ...``, without a traceback
(``HYDRA_FULL_ERROR=1`` or ``--debug`` shows it); any other exception is a bug and keeps its
traceback. Each subclass also derives from the built-in a caller would catch (``ValueError``...).
"""

from __future__ import annotations


class NanolightError(Exception):
    """Base class. `rank_specific`: only the rank that raised it knows (e.g. its disk is full), so
    that rank prints it too, not just rank 0."""

    rank_specific = False


class UsageError(NanolightError, ValueError):
    """A setting or input that cannot work (a layout, a loader, a return value); says the fix."""


class TrainingDiverged(NanolightError, RuntimeError):
    """The loss or gradient norm stopped being finite: training on would only spread NaN, and a
    checkpoint of that state would rotate the last good one away."""
