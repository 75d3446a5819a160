"""Plan a layout: every valid way to train a model on a cluster, with predicted memory and time.

    python scripts/plan.py model=smollm-1.7b trainer.seq_len=4096 +cluster.gpus=64 \
        +cluster.gpu=h100-sxm +plan.global_batch_tokens=2097152 [--json]

The recipe's own config keys (composed with `conf/` exactly as `recipes/smollm.py` does), plus
`+cluster.gpus`, `+cluster.gpu` (`planner/hardware.py`'s table: h100-sxm, h100-pcie, h100-nvl,
h200, h200-nvl, a100-40gb, a100-80gb, b200, l40s, l4, a10, rtx-4090; or cpu: this machine,
measured now) and `+plan.global_batch_tokens`. A knob named on the command line
(`+parallel.tp=2`, `trainer.micro_batch_size=4`, `trainer.precision=...`,
`trainer.activation_checkpointing=...`, ...) is pinned; the others are searched. `+plan.top=N`
limits the rows (the table shows 25 unless told). The table is sorted: layouts that fit first,
fastest first; the memory column is the most loaded rank's peak. `--json` prints the same rows
as a list of objects (the layout's fields, `memory_bytes` with its parts and `total`,
`step_time_s`, `tokens_per_s`, `mfu`, `fits`). Errors are one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout, not installed

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from nanolight.errors import UsageError  # noqa: E402
from nanolight.planner.hardware import hardware  # noqa: E402
from nanolight.planner.memory import Workload  # noqa: E402
from nanolight.planner.search import Prediction, no_fit_message, plan  # noqa: E402
from nanolight.pretrain import load_config  # noqa: E402
from nanolight.pretrain.auto import pinned_knobs  # noqa: E402
from nanolight.pretrain.schema import check_override_syntax, reported_errors, take_debug_flag  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"
GB = 1e9


def parse(argv: list[str]) -> tuple[Workload, int, int, str, dict[str, Any], int | None]:
    """(workload, gpus, global batch tokens, gpu name, pinned knobs, rows) from the overrides."""
    check_override_syntax(argv)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=argv)
    raw = OmegaConf.to_container(cfg, resolve=True)
    cluster, plan_cfg = raw.pop("cluster", {}) or {}, raw.pop("plan", {}) or {}
    for name, given, valid in (
        ("cluster", cluster, {"gpus", "gpu"}),
        ("plan", plan_cfg, {"global_batch_tokens", "top"}),
    ):
        unknown = sorted(set(given) - valid)
        if unknown:
            raise UsageError(f"unknown key(s) {[f'{name}.{k}' for k in unknown]}; valid: {sorted(valid)}")
    if "gpus" not in cluster or "gpu" not in cluster or "global_batch_tokens" not in plan_cfg:
        raise UsageError(
            "give the cluster and the batch: +cluster.gpus=N +cluster.gpu=h100-sxm +plan.global_batch_tokens=T"
        )
    for key, value in (
        ("+cluster.gpus", cluster["gpus"]),
        ("+plan.global_batch_tokens", plan_cfg["global_batch_tokens"]),
        ("+plan.top", plan_cfg.get("top", 1)),
        ("trainer.seq_len", raw["trainer"]["seq_len"]),  # compared below, before load_config checks it
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{key}={value!r} must be a positive integer")
    seq_len = raw["trainer"]["seq_len"]
    if seq_len > raw["model"]["max_position_embeddings"]:  # planning a longer context than the preset's
        note = (
            f"(planning at trainer.seq_len={seq_len}: to run it add model.max_position_embeddings={seq_len})"
        )
        print(note, file=sys.stderr)  # stdout stays the table or the JSON
        raw["model"]["max_position_embeddings"] = seq_len
    config = load_config(raw)  # every recipe key validated as the recipe does
    pinned = pinned_knobs(config, argv)
    hw = hardware(str(cluster["gpu"]))
    work = Workload(config.model, seq_len, hw.device)
    return work, int(cluster["gpus"]), int(plan_cfg["global_batch_tokens"]), hw, pinned, plan_cfg.get("top")


def table(rows: list[Prediction]) -> str:
    head = f"{'tp':>3} {'cp':>3} {'pp':>3} {'schedule':>16} {'v':>2} {'dp':>4} {'zero':>4} {'sp':>3} {'recompute':>9} "
    head += f"{'mbs':>4} {'accum':>5} {'precision':>11} | {'mem GB':>7} {'step s':>8} {'tokens/s':>10} {'MFU':>5} fits"
    lines = [head, "-" * len(head)]
    for p in rows:
        lay = p.layout
        lines.append(
            f"{lay.tp:>3} {lay.cp:>3} {lay.pp:>3} {lay.pp_schedule if lay.pp > 1 else '-':>16} {lay.pp_virtual:>2} {lay.dp:>4} "
            f"{lay.zero_stage:>4} {'y' if lay.sequence_parallel else '-':>3} {lay.activation_checkpointing:>9} "
            f"{lay.micro_batch_size:>4} {lay.accumulate_grad_batches:>5} {lay.precision:>11} | "
            f"{p.memory_bytes['total'] / GB:>7.1f} {p.step_time_s:>8.3f} {p.tokens_per_s:>10,.0f} "
            f"{p.mfu:>5.1%} {'yes' if p.fits else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    work, gpus, tokens, hw, pinned, top = parse(argv)
    predictions = plan(work, gpus, tokens, hw, pinned)
    if not any(p.fits for p in predictions):
        raise UsageError(no_fit_message(predictions, hw, gpus, work.seq_len))
    rows = predictions[: top or (len(predictions) if as_json else 25)]
    if as_json:
        print(json.dumps([p.as_dict() for p in rows], indent=1))
        return
    fitting = sum(p.fits for p in predictions)
    print(
        f"{len(predictions)} valid layouts on {gpus} x {hw.name}, {fitting} fit in {hw.memory_bytes / GB:.0f} GB; best first:"
    )
    print(table(rows))
    best = predictions[0]
    print(f"best: {best.layout.overrides()}")


if __name__ == "__main__":
    debug = take_debug_flag(sys.argv)
    with reported_errors(debug):
        main(sys.argv[1:])
