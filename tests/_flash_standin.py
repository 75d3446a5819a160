"""The `flash_standin` fixture: the stand-in flash_attn package (`_standins/flash_attn`: flash-attn
2's input checks, SDPA's numbers) importable, and CUDA reported available, so that
attn_implementation="flash_attention_2" builds through the model's own check on a CPU machine."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

STANDINS = Path(__file__).parent / "_standins"


@pytest.fixture
def flash_standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.syspath_prepend(str(STANDINS))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    module = importlib.import_module("flash_attn")
    assert module.__file__.startswith(str(STANDINS))
    module.calls.clear()
    yield module
    sys.modules.pop("flash_attn", None)
