"""The speed options as a user sets them: recipe keys (validated, with the fix in the message),
strategy arguments, and the recipe's AdamW kernel."""

from __future__ import annotations

import pytest
import torch

from nanolight.models import LlamaConfig
from nanolight.pretrain import ConfigError, load_config
from nanolight.pretrain.config import OptimConfig
from nanolight.pretrain.module import CausalLMPretrain, adamw_kernel
from nanolight.pretrain.run import build_strategy
from nanolight.strategies import Parallel3DStrategy, SingleDeviceStrategy


def _config(**trainer):
    return load_config({"trainer": trainer})


def test_recipe_keys_reach_the_strategy() -> None:
    config = _config(activation_checkpointing="selective", activation_checkpointing_every=2, compile=True)
    strategy = build_strategy(config)
    assert isinstance(strategy, SingleDeviceStrategy)
    assert strategy.blocks.recompute == ("selective", 2) and strategy.blocks.compile is True
    assert build_strategy(_config()).blocks.recompute == ("none", 1)


@pytest.mark.parametrize(
    ("trainer", "fragment"),
    [
        ({"activation_checkpointing": "some"}, "is not one of ['none', 'full', 'selective']"),
        ({"activation_checkpointing": "full", "activation_checkpointing_every": 0}, "must be >= 1"),
        ({"activation_checkpointing_every": 2}, "add trainer.activation_checkpointing=full"),
        ({"compile": "yes"}, "must be true or false"),
    ],
)
def test_bad_speed_keys_name_the_key_and_the_fix(trainer: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match="trainer.activation_checkpointing|trainer.compile") as err:
        _config(**trainer)
    assert fragment in str(err.value)


@pytest.mark.parametrize("cls", [SingleDeviceStrategy, Parallel3DStrategy])
def test_strategy_arguments_are_checked_at_construction(cls: type) -> None:
    with pytest.raises(ValueError, match="one of"):
        cls(activation_checkpointing="partial")
    with pytest.raises(ValueError, match=">= 1"):
        cls(activation_checkpointing="full", activation_checkpointing_every=0)


def test_recipe_adamw_uses_foreach_on_cpu_and_fused_on_cuda() -> None:
    assert adamw_kernel(torch.device("cuda", 0)) == {"fused": True}
    assert adamw_kernel(torch.device("cpu")) == {"foreach": True}
    config = LlamaConfig.preset("smollm-tiny", num_hidden_layers=1)
    module = CausalLMPretrain(config, OptimConfig(), seq_len=32, max_steps=4)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["foreach"] is True and optimizer.defaults["fused"] in (None, False)
