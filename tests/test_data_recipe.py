"""`python recipes/smollm.py` on prepared data, a mixture and a stream: the prepared embedded corpus
trains with the cached corpus's losses (the same batches) at dp=1 and dp=2, a mixture with document
fields runs, and a streaming run at dp=2 resumes with the uninterrupted run's losses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _data_helpers import prepared
from _dist import pythonpath
from test_recipe_e2e import BASE_OVERRIDES, REPO, losses, recipe

from nanolight.data import DataConfig
from nanolight.data.sources import embedded_corpus
from nanolight.data.tokenizer import embedded_tokenizer_dir

STEPS = ["trainer.max_steps=4", "logger=csv", "checkpoint.every_n_steps=2"]


@pytest.fixture(scope="module")
def cache_and_prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The recipe's cache (its embedded corpus and tokenizer) and that corpus prepared with that tokenizer."""
    cache = tmp_path_factory.mktemp("cache")
    cfg = DataConfig(cache_dir=str(cache), embedded_max_mb=2, tokenizer_train_mb=1)  # BASE_OVERRIDES' sizes
    corpus = embedded_corpus(cfg.cache_root, cfg.embedded_max_mb)
    out = tmp_path_factory.mktemp("prepared") / "stdlib"
    prepared(corpus, str(out), embedded_tokenizer_dir(cfg, corpus), num_proc=2, cache_dir=str(cache))
    return cache, out


@pytest.mark.slow
def test_prepared_data_trains_like_the_token_file_at_dp1_and_dp2(tmp_path, cache_and_prepared) -> None:
    cache, out = cache_and_prepared
    recipe(tmp_path / "flat", cache, *STEPS)
    recipe(tmp_path / "prep", cache, *STEPS, f"data.path={out}")
    recipe(
        tmp_path / "dp2", cache, *STEPS, f"data.path={out}", "trainer.micro_batch_size=2", "+parallel.dp=2"
    )
    ref = losses(tmp_path / "flat")
    assert sorted(ref) == [1, 2, 3, 4]
    for run in ("prep", "dp2"):
        got = losses(tmp_path / run)
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=1e-5), (run, step, got[step], ref[step])


@pytest.mark.slow
def test_mixture_with_document_fields_runs(tmp_path, cache_and_prepared) -> None:
    cache, out = cache_and_prepared
    mix = f"data.mixture=[{{path: {out}, weight: 0.7}}, {{path: {out}, weight: 0.3}}]"
    recipe(tmp_path / "mix", cache, *STEPS, mix, "data.document_mask=true")
    assert sorted(losses(tmp_path / "mix")) == [1, 2, 3, 4]


@pytest.mark.slow
def test_streaming_at_dp2_resumes_exactly_and_refuses_another_dp(tmp_path, cache_and_prepared) -> None:
    cache, _ = cache_and_prepared
    corpus = next((cache / "corpus").glob("*[!k]/corpus.jsonl"))
    stream = [f"data.path={corpus}", "data.streaming=true", "data.val_blocks=8", "data.shuffle_buffer=16"]
    dp2 = [*STEPS, *stream, "trainer.micro_batch_size=2", "+parallel.dp=2"]
    full = tmp_path / "full"
    recipe(full, cache, *dp2)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    (resumed / "checkpoints" / "last").write_text("step-2\n")
    recipe(resumed, cache, *dp2, "checkpoint.resume=last")
    ref, got = losses(full), losses(resumed)
    assert sorted(got) == [3, 4]
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), (step, got[step], ref[step])
    one = tmp_path / "dp1"
    (one / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step-2", one / "checkpoints" / "step-2")
    (one / "checkpoints" / "last").write_text("step-2\n")
    cmd = [sys.executable, str(REPO / "recipes" / "smollm.py"), f"trainer.default_root_dir={one}"]
    cmd += [f"data.cache_dir={cache}", *BASE_OVERRIDES, *STEPS, *stream, "checkpoint.resume=last"]
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO), "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and "saved at dp=2 and is resumed at dp=1" in proc.stdout + proc.stderr
