"""A pretraining run's checkpoint exports to a complete Hugging Face directory: weights, config,
generation config and the run's tokenizer, so `pipeline("text-generation")` runs on it as is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from test_recipe_e2e import REPO, recipe


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nanolight-cache")


def test_tp2_run_exports_a_directory_pipeline_loads(tmp_path: Path, cache_dir: Path) -> None:
    run = tmp_path / "run"
    recipe(
        run, cache_dir, "trainer.max_steps=2", "checkpoint.every_n_steps=2", "logger=csv", "+parallel.tp=2"
    )
    step = run / "checkpoints" / "step-2"
    assert (step / "tokenizer.json").is_file() and (step / "tokenizer_config.json").is_file()
    export = tmp_path / "hf"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "convert_nanolight_to_hf.py"),
         "--checkpoint-path", str(run / "checkpoints" / "last"), "--save-path", str(export)],
        check=True, capture_output=True, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    names = {p.name for p in export.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation.get("eos_token_id") == tokenizer.eos_token_id is not None
    generate = transformers.pipeline("text-generation", model=str(export), device="cpu")
    out = generate("def main(", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert out.startswith("def main(") and len(tokenizer(out)["input_ids"]) > len(
        tokenizer("def main(")["input_ids"]
    )
