"""Pretrain a SmolLM-style (Llama architecture) model.

    python recipes/smollm.py                                  # smollm-tiny on the embedded corpus
    python recipes/smollm.py model=smollm-135m +parallel.tp=2
    torchrun --nproc_per_node=8 recipes/smollm.py model=smollm-1.7b +parallel.tp=8

Configs live in conf/; every key is validated (nanolight/pretrain/config.py) before anything runs.
"""

import sys

import hydra
from omegaconf import DictConfig

from nanolight.pretrain import ConfigError, PretrainConfig, load_config, run
from nanolight.pretrain.schema import check_override_keys


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(load_config(cfg))
    except ConfigError as err:
        print(f"nanolight: config error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    try:  # name the valid keys for a misspelled override before Hydra composes
        check_override_keys(PretrainConfig, sys.argv[1:], groups=("model", "data", "logger"))
    except ConfigError as err:
        print(f"nanolight: config error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
