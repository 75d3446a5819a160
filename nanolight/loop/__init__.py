"""The parts of `NanoTrainer`'s loop, kept out of `trainer.py` so the loop reads top to bottom:
its config, setup (callbacks, loggers, seeds), the per-micro-batch step, metrics from
`self.log`, `configure_optimizers` forms, resumable data iteration, and checkpoint state."""
