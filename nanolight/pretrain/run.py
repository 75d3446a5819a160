"""Build and run a pretraining job from a validated config: what `recipes/smollm.py` calls.

Order matters and is chosen so that a bad run fails fast and in one place:
1. validate the whole config (every key, the parallel layout against the model) — no process
   spawned, nothing written;
2. check the run directory (never silently overwrite a run that has checkpoints);
3. prepare the data in this process (tokenize once into the cache; check the tokenizer fits
   the model and the corpus fills a global batch) — ranks spawned later reuse the cache;
4. start the processes (the strategy's launcher), then each rank builds its own data shard,
   module, loggers and callbacks, and `NanoTrainer.fit` runs.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import yaml

from nanolight.callbacks import (
    Callback,
    DivergenceCheck,
    GreedySamples,
    LearningRateMonitor,
    ModelCheckpoint,
    ThroughputMonitor,
)
from nanolight.checkpoint.atomic import atomic_directory, atomic_write_text
from nanolight.checkpoint.pretrained import run_extras
from nanolight.checkpoint.reader import CheckpointReader
from nanolight.checkpoint.save import FORMAT_NAME, ExportExtras
from nanolight.data import BatchGeometry, DataConfig, build_datamodule, vocab_size
from nanolight.loggers import CSVLogger, Logger, WandbLogger
from nanolight.loggers.wandb_logger import has_wandb_credentials
from nanolight.parallel.launcher import detect_environment
from nanolight.planner import layout as planning
from nanolight.pretrain.auto import Prediction, PredictionCheck, auto_layout
from nanolight.pretrain.config import ConfigError, PretrainConfig, to_dict
from nanolight.pretrain.lock import run_lock
from nanolight.pretrain.module import CausalLMPretrain, held_out
from nanolight.pretrain.report import EdgeValidations, RunReport, saved_wandb_id
from nanolight.strategies import Parallel3DStrategy, SingleDeviceStrategy, Strategy
from nanolight.trainer import NanoTrainer

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # carried to the HF export


def check_layout(config: PretrainConfig) -> None:
    """The parallel layout must split this model (the planner's one check); raised before any
    process starts."""
    t = config.trainer
    precision = None if t.precision == "auto" else t.run_precision  # auto falls back (`build_strategy`)
    try:
        planning.check_layout(config.parallel, config.model, t.seq_len, t.accumulate_grad_batches, precision)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def check_run_dir(config: PretrainConfig) -> Path:
    """A fresh run must not write over another run's checkpoints; resuming needs a checkpoint."""
    root = Path(config.trainer.default_root_dir)
    ckpt_dir = root / "checkpoints"
    resume = config.checkpoint.resume
    has_checkpoints = ckpt_dir.is_dir() and any(
        p.name == "last" or p.name.startswith("step-") for p in ckpt_dir.iterdir()
    )
    if resume is None and has_checkpoints:
        raise ConfigError(
            f"run directory {root} already holds checkpoints; continue it with checkpoint.resume=last, "
            f"or start a new run with trainer.default_root_dir=<new dir>"
        )
    if resume is not None and resume != "last" and not Path(resume).exists():
        raise ConfigError(f"checkpoint.resume={resume!r}: no such checkpoint directory")
    if resume is not None and resume != "last":
        CheckpointReader.open(resume)  # a data or model directory is named now, not after tokenizing
    if config.checkpoint.init_from is not None:
        if resume is not None:
            raise ConfigError("checkpoint.init_from starts a fresh run from weights; drop it when resuming")
        init_from = config.checkpoint.init_from
        if not (Path(init_from) / "config.json").exists():
            raise ConfigError(
                f"checkpoint.init_from={init_from!r} is not a nanolight model directory "
                "(no config.json); convert a Hugging Face checkpoint with scripts/convert_hf_to_nanolight.py"
            )
        if _is_hf_directory(Path(init_from)):  # e.g. an export of scripts/convert_nanolight_to_hf.py
            raise ConfigError(
                f"checkpoint.init_from={init_from!r} is a Hugging Face model directory, not a nanolight one: "
                f"convert it first (python scripts/convert_hf_to_nanolight.py {init_from} <dir>) and init from <dir>"
            )
    return root


def _is_hf_directory(path: Path) -> bool:
    """Whether `path`'s config.json is a Hugging Face model's (no nanolight format, a model type)."""
    try:
        meta = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False  # unreadable: the loader names the file
    return (
        isinstance(meta, dict)
        and meta.get("format") != FORMAT_NAME
        and ("model_type" in meta or "architectures" in meta)
    )


def build_data(config: PretrainConfig, dp_rank: int = 0, dp_size: int = 1):
    t, data = config.trainer, config.data
    batches = BatchGeometry(
        t.seq_len, t.micro_batch_size, t.accumulate_grad_batches, dp_rank, dp_size, config.seed
    )
    dm = build_datamodule(data, batches)
    if vocab_size(dm.tokenizer) > config.model.vocab_size:
        raise ConfigError(
            f"the tokenizer ({dm.tokenizer.name_or_path}) has {vocab_size(dm.tokenizer)} tokens but the model's "
            f"vocab_size is {config.model.vocab_size}; pick a model preset with a larger vocabulary or "
            f"override model.vocab_size"
        )
    return dm


def build_strategy(config: PretrainConfig, export: ExportExtras | None = None) -> Strategy:
    """The layout's strategy; `export`: what every checkpoint carries for a complete export."""
    p, t = config.parallel, config.trainer
    speed = dict(
        export=export,
        activation_checkpointing=t.activation_checkpointing,
        activation_checkpointing_every=t.activation_checkpointing_every,
        compile=t.compile,
    )
    env = detect_environment()  # torchrun/srun, or None under plain python
    precision = t.run_precision
    if (p.tp, p.pp, p.cp, p.dp) == (1, 1, 1, 1) and (env is None or env.world_size == 1):
        return SingleDeviceStrategy(precision=precision, **speed)
    if t.precision == "auto" and precision == "bf16-master" and p.zero_stage == 0 and (p.dp, p.cp) != (1, 1):
        # bf16-master keeps its fp32 masters in ZeRO-1's optimizer: plain replicas use autocast
        precision = "bf16-mixed"
    # under torchrun/srun the strategy checks that the world equals tp*pp*cp*dp (or fills dp="auto")
    return Parallel3DStrategy.from_config(
        p, precision=precision, pretrained=config.checkpoint.init_from, **speed
    )


def build_loggers(config: PretrainConfig, root: Path) -> list[Logger]:
    lg = config.logger
    # name="" and version="": metrics.csv stays at <root>/metrics.csv and continues across resumes;
    # merge_rows: one row per logged step, whichever callbacks logged in it
    csv_logger = CSVLogger(save_dir=root, name="", version="", merge_rows=True)
    loggers: list[Logger] = [csv_logger] if lg.csv else []
    if lg.wandb:
        offline = lg.offline if lg.offline is not None else not has_wandb_credentials()
        # a resume continues the run's wandb run (its id recorded by `RunReport`), one curve
        run_id = saved_wandb_id(root) if config.checkpoint.resume is not None else None
        continued = {"id": run_id, "resume": "allow"} if run_id else {}
        loggers.append(
            WandbLogger(
                project=lg.project,
                name=lg.name,
                offline=offline,
                save_dir=root,
                log_model=lg.log_model,
                **continued,
            )
        )
    return loggers


def build_trainer(config: PretrainConfig, strategy: Strategy, root: Path, *extra: Callback) -> NanoTrainer:
    t, c = config.trainer, config.checkpoint
    loggers = build_loggers(config, root)
    # LearningRateMonitor needs a logger (as Lightning's, it raises without one); the validation
    # before step 1 comes first, so no timer counts it
    callbacks = [
        EdgeValidations(),
        *([LearningRateMonitor()] if loggers else []),
        ThroughputMonitor(),
        FinishedRunNotice(),
        *extra,
    ]
    if t.stop_on_divergence:  # checked where the step reads values anyway (no sync per step)
        callbacks.append(DivergenceCheck())
    if c.every_n_steps is not None or c.save_last:
        callbacks.append(
            ModelCheckpoint(  # the recipe's layout, explicitly: <root>/checkpoints/step-<N>
                dirpath=root / "checkpoints",
                filename="step-{step}",
                auto_insert_metric_name=False,
                every_n_train_steps=c.every_n_steps,
                save_last=c.save_last,
                # no monitor: save_top_k=1 keeps only the newest, plus keep_last_n newest; -1 keeps all
                save_top_k=-1 if c.keep_last_n is None else 1,
                keep_last_n=c.keep_last_n,
                enable_version_counter=False,  # a step saved again (an older resume) replaces step-<N>
                save_on_train_epoch_end=True,  # without every_n_steps: at each epoch end, not per validation
                save_on_train_end=True,  # the end of a run is always saved
            )
        )
    trainer = NanoTrainer(
        max_steps=t.max_steps,
        max_epochs=t.max_epochs,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val,
        precision=t.run_precision,
        val_check_interval=t.val_check_interval,
        limit_val_batches=t.limit_val_batches,
        num_sanity_val_steps=0,  # a fresh run validates in full before step 1 (`EdgeValidations`)
        log_every_n_steps=t.log_every_n_steps,
        callbacks=callbacks,
        logger=loggers or False,
        strategy=strategy,
        default_root_dir=root,
        enable_progress_bar=t.enable_progress_bar,
        enable_checkpointing=c.every_n_steps is not None or c.save_last,
        seed=config.seed,
        deterministic=t.deterministic,
    )
    trainer.preemption.save_on_interrupt = True  # the recipe's Ctrl-C: save, then stop (exit 130)
    return trainer


class FinishedRunNotice(Callback):
    """A resume of a run that already reached ``max_steps`` trains nothing (Lightning says so only
    at info level): one line saying so and how to continue, so exit 0 is not a puzzle."""

    def __init__(self) -> None:
        self.trained = False

    def on_train_start(self, trainer: NanoTrainer, pl_module: object) -> None:
        self.trained = True

    def on_fit_end(self, trainer: NanoTrainer, pl_module: object) -> None:
        if trainer.is_global_zero and not self.trained and 0 < trainer.max_steps <= trainer.global_step:
            print(
                f"nanolight: the run in {trainer.default_root_dir} already reached trainer.max_steps="
                f"{trainer.max_steps} (step {trainer.global_step}); nothing to train: raise trainer.max_steps "
                "to continue it",
                flush=True,
            )


def save_config(config: PretrainConfig, root: Path) -> None:
    atomic_write_text(root / "config.yaml", yaml.safe_dump(to_dict(config), sort_keys=False))


def run(config: PretrainConfig, overrides: list[str] | None = None) -> NanoTrainer:
    """Pretrain per `config` (already validated by `load_config`). Returns the finished trainer.
    Under `+parallel=auto` the planner picks the layout first; `overrides` (the command line) says
    which of its knobs the user pinned."""
    started, prediction = time.monotonic(), None
    if config.auto_parallel:
        config, prediction = auto_layout(config, list(overrides or ()))
    check_layout(config)
    with run_lock(Path(config.trainer.default_root_dir)):  # before anything is written there
        return _run(config, prediction, list(overrides or ()), started)


def _run(
    config: PretrainConfig, prediction: Prediction | None, overrides: list[str], started: float
) -> NanoTrainer:
    """`run`'s body, under the run directory's lock."""
    root = check_run_dir(config)
    dm = build_data(config)  # tokenizes into the cache once, before any rank is spawned
    # every checkpoint carries the tokenizer and its HF token ids: an export is a complete HF directory
    tokenizer_dir = root / "tokenizer"
    token_ids = {k: getattr(dm.tokenizer, k) for k in TOKEN_IDS if getattr(dm.tokenizer, k) is not None}
    strategy = build_strategy(config, run_extras(tokenizer_dir, token_ids))
    strategy.setup_environment()  # plain python + parallel: re-launches this script as N ranks here
    # the whole split (dm is every dp rank's yet), measured where it is used: not by a launcher, which
    # would hold its ranks back while it decodes and compresses it
    heldout = held_out(dm.val_loader, dm.tokenizer) if dm.val_loader is not None else None
    if strategy.parallel.dp > 1:
        ctx = strategy.parallel.context
        dm = build_data(config, ctx.dp_rank, ctx.dp_size)
    if strategy.is_global_zero:
        save_config(config, root)
        with atomic_directory(tokenizer_dir, overwrite=True) as tmp:
            dm.tokenizer.save_pretrained(str(tmp))
        if heldout is not None:
            print(f"nanolight: {heldout.summary()}", flush=True)
    t = config.trainer
    bytes_per_token = heldout.bytes_per_token if heldout else None
    module = CausalLMPretrain(
        config.model, config.optim, t.seq_len, t.max_steps, config.checkpoint.init_from, bytes_per_token
    )
    checks = [PredictionCheck(prediction)] if prediction is not None else []
    report = RunReport(root, overrides, started, heldout)
    trainer = build_trainer(config, strategy, root, GreedySamples(dm.tokenizer), report, *checks)
    if config.checkpoint.resume is not None:  # Lightning's warning is for a fresh run writing over old files
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    # resume="last" with no checkpoint yet starts fresh with a warning, as Lightning does
    trainer.fit(module, dm.train_loader, dm.val_loader, ckpt_path=config.checkpoint.resume)
    summary = report.summary() if trainer.is_global_zero else None
    if summary:  # after the loggers closed: the last thing the run prints
        print(summary, flush=True)
    return trainer


__all__ = ["ConfigError", "DataConfig", "run"]
