"""A layout's real program for two steps on this CPU: fake tensors, a fake process group, each
rank role once (`nanolight/pretrain/dry_run.py`). The recipe's keys; the same as
``python recipes/smollm.py ... +dry_run=true``.

    python scripts/dry_run.py model=smollm-1.7b trainer.seq_len=2048 trainer.micro_batch_size=1 \\
        trainer.precision=bf16-master +parallel.zero_stage=1 +cluster.gpus=8 +cluster.gpu=h100-sxm
"""

import sys

import hydra
from omegaconf import DictConfig, open_dict

from nanolight.pretrain import PretrainConfig, load_config
from nanolight.pretrain.dry_run import dry_run
from nanolight.pretrain.schema import check_override_keys, reported_errors, take_debug_flag

DEBUG = take_debug_flag(sys.argv)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported_errors(DEBUG):
        with open_dict(cfg):
            cfg.dry_run = True
        print(dry_run(load_config(cfg, sys.argv[1:])).render())


if __name__ == "__main__":
    with reported_errors(DEBUG):
        check_override_keys(PretrainConfig, sys.argv[1:], groups=("model", "data", "logger"))
    main()
