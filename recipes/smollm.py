"""Pretrain a SmolLM-style (Llama architecture) model.

    python recipes/smollm.py                                  # smollm-tiny on the embedded corpus
    python recipes/smollm.py model=smollm-135m +parallel.tp=2
    python recipes/smollm.py model=smollm-135m +parallel=auto +cluster.gpus=2   # the planner's pick
    torchrun --nproc_per_node=8 recipes/smollm.py model=smollm-1.7b +parallel.tp=8
    python recipes/smollm.py model=smollm-1.7b +parallel.dp=8 +parallel.zero_stage=1 +dry_run=true \
        +cluster.gpus=8 +cluster.gpu=h100-sxm                 # memory, traffic, step time; nothing trained

Configs live in conf/; every key is validated (nanolight/pretrain/config.py) before anything runs.
Errors are one line (``nanolight: error: ...``); ``--debug`` shows their traceback. Ctrl-C saves the
current step, then exits 130; a second Ctrl-C stops at once.
"""

import sys

import hydra
from omegaconf import DictConfig

from nanolight.pretrain import PretrainConfig, load_config, run
from nanolight.pretrain.schema import check_override_keys, reported_errors, take_debug_flag

DEBUG = take_debug_flag(sys.argv)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with reported_errors(DEBUG):
        config = load_config(cfg, sys.argv[1:])
        if config.dry_run:  # every role's real program for two steps, fake tensors, a fake world
            from nanolight.pretrain.dry_run import dry_run  # torch's trackers (1 s): only when dry-running

            print(dry_run(config).render())
            return
        trainer = run(config, sys.argv[1:])  # the command line: the knobs +parallel=auto keeps
    if trainer.preempted_by == "SIGINT":  # Ctrl-C: saved (the line says where), but not finished
        sys.exit(130)


if __name__ == "__main__":
    with reported_errors(DEBUG):  # name the valid keys for a misspelled override before Hydra composes
        check_override_keys(PretrainConfig, sys.argv[1:], groups=("model", "data", "logger"))
    main()
