"""A training step directory saved by Parallel3DStrategy at any tp x pp x dp layout is a
nanolight checkpoint: `load_pretrained` reads it, `convert_nanolight_to_hf.py` turns it into a
transformers model whose logits equal the trained model's, and a missing or truncated shard is
an error naming the file."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import _tiny as tiny
import pytest
import torch
import transformers
from _dist import REPO_ROOT, run_distributed
from _tiny import tiny_config
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from nanolight import NanoTrainer
from nanolight.checkpoint import write_last_pointer
from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.models.pretrained import (
    convert_nanolight_to_hf,
    load_pretrained,
    read_checkpoint,
    save_pretrained,
)
from nanolight.parallel.tensor_parallel.apply import gather_full, shard_chunks, shard_dims
from nanolight.strategies.parallel3d import Parallel3DStrategy

SEED, STEPS, ACCUM, MICRO, T, VOCAB = 5, 3, 2, 2, 16, 128
# name -> (tp, pp, dp, zero_stage, tied embeddings)
LAYOUTS = {
    "tp2-pp2-tied": (2, 2, 1, 0, True),
    "pp2-dp2-zero1-untied": (1, 2, 2, 1, False),
    "1x1x1-untied": (1, 1, 1, 0, False),
}


def _config(tied: bool) -> LlamaConfig:
    return tiny_config(vocab=VOCAB, layers=4, tied=tied)


class TinyLM(tiny.TinyLM):
    def __init__(self, tied: bool) -> None:
        super().__init__(_config(tied), lr=1e-2)  # a large lr: the weights move visibly


def _loader(dp_rank: int) -> DataLoader:
    """Each dp replica its own sequences (tp and pp ranks of one replica read the same ones)."""
    g = torch.Generator().manual_seed(100 + dp_rank)
    ids = torch.randint(0, VOCAB, (STEPS * ACCUM * MICRO, T), generator=g)
    return DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=MICRO)


def _train_worker(rank: int, world: int, root: str, layout: str) -> bool:
    """Train, save a step directory, and write the trained weights (gathered over tp) per stage."""
    tp, pp, dp, zero_stage, tied = LAYOUTS[layout]
    strategy = Parallel3DStrategy(tp=tp, pp=pp, dp=dp, zero_stage=zero_stage)
    strategy.setup_environment()
    ctx = strategy.parallel.context
    trainer = NanoTrainer(
        use_distributed_sampler=False,  # each rank is given its own data
        max_steps=STEPS,
        accumulate_grad_batches=ACCUM,
        strategy=strategy,
        seed=SEED,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    module = TinyLM(tied)
    trainer.fit(module, train_dataloaders=_loader(ctx.dp_rank))
    trainer.save_checkpoint(Path(root) / "step", update_last=False)  # collective
    # the live weights, independently of the checkpoint code: every tp shard gathered (collective)
    dims, chunks = shard_dims(module.model), shard_chunks(module.model)
    full = {
        name: gather_full(p.detach(), dims[name], ctx.tp_group, chunks.get(name, 1)).clone()
        for name, p in module.model.named_parameters()
    }
    if ctx.tp_rank == 0 and ctx.dp_rank == 0:  # one writer per pipeline stage
        save_file(full, str(Path(root) / f"trained-pp{ctx.pp_rank}.safetensors"))
    return True


@pytest.fixture(scope="module", params=list(LAYOUTS))
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(layout, step dir, the trained model as one LlamaForCausalLM) -- one distributed run per layout."""
    layout = request.param
    tp, pp, dp, _, tied = LAYOUTS[layout]
    root = tmp_path_factory.mktemp(layout)
    run_distributed(_train_worker, tp * pp * dp, str(root), layout, timeout=300, pg_timeout=90)
    state: dict[str, torch.Tensor] = {}
    for stage in range(pp):  # layer names are global, so the stages' dicts just merge
        for name, tensor in load_file(str(root / f"trained-pp{stage}.safetensors")).items():
            if name in state:  # a tied embedding lives on the first and the last stage
                assert torch.equal(state[name], tensor), name
            state[name] = tensor
    model = LlamaForCausalLM(_config(tied))
    if tied:  # a last stage may hold the head as its own copy of the embedding: they must agree
        head = state.pop("lm_head.weight", None)
        assert head is None or torch.equal(head, state["model.embed_tokens.weight"])
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    return layout, root / "step", model.eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(9))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_step_dir_converts_to_hf_with_the_trained_logits(trained: tuple, tmp_path: Path) -> None:
    layout, step, model = trained
    assert (step / "index.json").is_file() and not (step / "model.safetensors").exists()

    # read_checkpoint returns exactly what the single-file format holds for the trained model
    save_pretrained(model, tmp_path / "single")
    ref_config, ref_sd, _ = read_checkpoint(tmp_path / "single")
    config, sd, _ = read_checkpoint(step)
    assert config == ref_config
    assert sorted(sd) == sorted(ref_sd)
    assert ("lm_head.weight" in sd) is not config.tie_word_embeddings
    for name, tensor in ref_sd.items():
        assert torch.equal(sd[name], tensor), name

    ids = _ids()
    with torch.no_grad():
        ref = model(ids)
        loaded = load_pretrained(step)
        torch.testing.assert_close(loaded(ids), ref, rtol=0, atol=0)

    write_last_pointer(step)  # what the trainer does after a save: `last` names step
    out = subprocess.run(  # the script itself, given the run's `last` pointer
        [
            sys.executable,
            str(Path(REPO_ROOT) / "scripts" / "convert_nanolight_to_hf.py"),
            "--checkpoint-path",
            str(step.parent / "last"),
            "--save-path",
            str(tmp_path / "hf"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert hf.config.tie_word_embeddings == config.tie_word_embeddings
    with torch.no_grad():
        assert _rel_err(hf(ids).logits, ref) < 1e-5, layout


def _script_main() -> object:
    spec = importlib.util.spec_from_file_location(
        "convert_nanolight_to_hf", Path(REPO_ROOT) / "scripts" / "convert_nanolight_to_hf.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_missing_or_truncated_shard_names_the_file(
    trained: tuple, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    layout, step, _ = trained
    shards = sorted(p.name for p in step.glob("model-*.safetensors"))
    assert shards, f"no model shards in {sorted(p.name for p in step.iterdir())}"
    victim = shards[-1]

    missing = tmp_path / "missing"
    shutil.copytree(step, missing)
    (missing / victim).unlink()
    with pytest.raises(FileNotFoundError, match=victim):
        convert_nanolight_to_hf(missing, tmp_path / "hf-missing")
    with pytest.raises(FileNotFoundError, match=victim):
        load_pretrained(missing)
    assert not (tmp_path / "hf-missing").exists()

    truncated = tmp_path / "truncated"
    shutil.copytree(step, truncated)
    size = (truncated / victim).stat().st_size
    with open(truncated / victim, "r+b") as f:
        f.truncate(size - 100)
    assert (
        _script_main()(["--checkpoint-path", str(truncated), "--save-path", str(tmp_path / "hf-trunc")]) == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("error: ") and victim in err and err.count("\n") == 1, err
    assert not (tmp_path / "hf-trunc").exists()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_single_device_step_dir_converts_to_hf(tmp_path: Path, tied: bool) -> None:
    """The default one-process run (SingleDeviceStrategy) writes a model directory too."""
    from nanolight.strategies.base import SingleDeviceStrategy

    trainer = NanoTrainer(
        use_distributed_sampler=False,  # each rank is given its own data
        max_steps=STEPS, accumulate_grad_batches=ACCUM, strategy=SingleDeviceStrategy("cpu"), seed=SEED,
        logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    module = TinyLM(tied)
    trainer.fit(module, train_dataloaders=_loader(0))
    step = Path(trainer.checkpoint_callback.best_model_path)  # Lightning names it epoch=0-step=3
    assert (step / "index.json").is_file() and (step / "config.json").is_file()
    model = module.model.eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(ids)
        torch.testing.assert_close(load_pretrained(step)(ids), ref, rtol=0, atol=0)
    out = convert_nanolight_to_hf(tmp_path / "checkpoints" / "last", tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert hf.config.tie_word_embeddings is tied
    with torch.no_grad():
        assert _rel_err(hf(ids).logits, ref) < 1e-5
