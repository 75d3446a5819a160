"""`WandbLogger`: Weights & Biases, online when logged in, offline otherwise -- never a prompt.

"Logged in" means an API key is available without asking: ``WANDB_API_KEY`` or a ``.netrc``
entry for the W&B host. Without one the run is written offline under ``<save_dir>/wandb`` and
can be uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only

from nanolight.loggers.base import Logger


def has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbLogger(Logger):
    """Args: ``project``, ``name`` (the run's display name), ``offline`` (force offline),
    ``save_dir`` (default: the trainer's ``default_root_dir``), ``log_model`` (True: upload the
    last checkpoint at the end; "all": every checkpoint), ``version``/``id`` (the run id, to
    resume a run), extra ``wandb.init`` kwargs (``resume``, ``tags``, ...).

    As Lightning's WandbLogger, ``name`` is the *project* and ``version`` the run id (the id given,
    or the run's once it exists), so ``ModelCheckpoint``'s default directory is
    ``<save_dir>/<project>/<run id>/checkpoints``."""

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        offline: bool = False,
        save_dir: str | Path | None = None,
        log_model: bool | str = False,
        version: str | None = None,
        id: str | None = None,  # noqa: A002 (Lightning's and wandb's argument name)
        **init_kwargs: Any,
    ) -> None:
        self.project, self._name, self.offline = project, name, offline
        super().__init__(save_dir)
        self._id = version or id
        if self._id is not None:
            init_kwargs["id"] = self._id
        self.log_model, self.init_kwargs = log_model, init_kwargs
        self._run: Any = None
        self._texts: list[list[Any]] = []
        self._last_checkpoint: str | None = None

    @property
    def name(self) -> str | None:
        """The project (not the run's display name), as Lightning's WandbLogger."""
        return self._run.project if self._run is not None else self.project

    @property
    def version(self) -> str | None:
        """The run id; None until the run exists unless an id was given (as Lightning)."""
        return self._run.id if self._run is not None else self._id

    @property
    def mode(self) -> str:
        return "offline" if self.offline or not has_wandb_credentials() else "online"

    @property
    def experiment(self) -> Any:
        """The ``wandb`` run, created on first use (rank zero only)."""
        if self._run is None:
            import wandb

            save_dir = Path(self._save_dir or ".")
            save_dir.mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(
                project=self.project, name=self._name, dir=str(save_dir), mode=self.mode, **self.init_kwargs
            )
        return self._run

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.experiment.log(dict(metrics), step=step)

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.experiment.config.update(params, allow_val_change=True)

    @rank_zero_only
    def log_text(self, key: str, text: str, step: int) -> None:
        import wandb

        self._texts.append([step, text])  # one table, growing with the run
        self.experiment.log({key: wandb.Table(columns=["step", "text"], data=self._texts)}, step=step)

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        path = checkpoint_callback.last_checkpoint_saved
        self._last_checkpoint = path
        if self.log_model == "all":
            self._log_checkpoint(path)

    def _log_checkpoint(self, path: str) -> None:
        import wandb

        artifact = wandb.Artifact(f"model-{self.experiment.id}", type="model", metadata={"path": path})
        artifact.add_dir(path)
        self.experiment.log_artifact(artifact, aliases=[Path(path).name, "latest"])

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._run is None:
            return
        if self.log_model is True and self._last_checkpoint and Path(self._last_checkpoint).is_dir():
            self._log_checkpoint(self._last_checkpoint)
        self._run.finish(exit_code=0 if status == "success" else 1)
        self._run = None
