"""HF -> nanolight -> HF is lossless; tokenizers travel; bad input fails cleanly and atomically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from nanolight.models import LlamaConfig, LlamaForCausalLM
from nanolight.models.llama_config import DIRECTORY_ROPE_KEY
from nanolight.models.pretrained import (
    convert_hf_to_nanolight,
    convert_nanolight_to_hf,
    load_pretrained,
    save_pretrained,
)

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(
    vocab_size=64,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    rms_norm_eps=1e-5,
)


# Llama 3.1's RoPE (transformers 5.x's rope_parameters; 4.x called it rope_scaling)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def make_hf(
    path: Path, dtype=torch.float32, shard: bool = False, **overrides
) -> transformers.LlamaForCausalLM:
    """A random HF Llama saved at `path`, with a tiny word-level tokenizer next to it."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**BASE, "num_key_value_heads": 2, **overrides})
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(str(path), max_shard_size="20KB" if shard else "5GB")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"])
    tok.train_from_iterator(["the quick brown fox", "jumps over the lazy dog"], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(path))
    return model


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def assert_tokenizer_works(path: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert len(tok("the lazy fox")["input_ids"]) == 3
    assert tok.decode(tok("the lazy fox")["input_ids"]) == "the lazy fox"


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


# ---------------------------------------------------------------------- lossless round trip
@pytest.mark.parametrize(
    "kw",
    [
        dict(tie_word_embeddings=True),
        dict(tie_word_embeddings=False, num_key_value_heads=1, dtype=torch.bfloat16),
        dict(tie_word_embeddings=False, num_key_value_heads=6, shard=True),
    ],
    ids=["gqa-tied", "mqa-untied-bf16", "mha-sharded"],
)
def test_hf_nanolight_hf_is_bit_identical(tmp_path, kw):
    hf = make_hf(tmp_path / "hf", **kw)
    convert_hf_to_nanolight(tmp_path / "hf", tmp_path / "nl")
    assert_tokenizer_works(tmp_path / "nl")
    meta = json.loads((tmp_path / "nl" / "config.json").read_text())
    assert meta["format"] == "nanolight" and meta["format_version"] == 2 and meta["sharding"] is None
    with safe_open(str(tmp_path / "nl" / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert ("lm_head.weight" in stored) is (not hf.config.tie_word_embeddings)
    assert "model.layers.0.self_attn.qkv_proj.weight" in stored

    convert_nanolight_to_hf(tmp_path / "nl", tmp_path / "hf2")
    assert_tokenizer_works(tmp_path / "hf2")
    before, after = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "hf2")
    assert sorted(before) == sorted(after)
    for name, t in before.items():
        assert t.dtype == after[name].dtype and torch.equal(t, after[name]), name

    # compare with the original directory loaded the same way (a model cast with .to(bf16) would
    # also have cast its RoPE buffer, unlike from_pretrained)
    original = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=hf.dtype).eval()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"), dtype=hf.dtype).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, original(ids).logits)
    for key in ("bos_token_id", "eos_token_id"):
        assert reloaded.config.to_dict()[key] == hf.config.to_dict()[key]


def test_llama3_rope_scaling_round_trips(tmp_path):
    """A Llama 3.1-style config: HF -> nanolight -> HF gives transformers the same RoPE parameters,
    nanolight computes transformers' logits with them, and a model saved again keeps them."""
    hf = make_hf(tmp_path / "hf", rope_parameters=dict(LLAMA3_ROPE), max_position_embeddings=131072)
    convert_hf_to_nanolight(tmp_path / "hf", tmp_path / "nl")
    assert json.loads((tmp_path / "nl" / "config.json").read_text())[DIRECTORY_ROPE_KEY] == {
        k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"
    }
    convert_nanolight_to_hf(tmp_path / "nl", tmp_path / "hf2")
    rope = transformers.LlamaConfig.from_pretrained(str(tmp_path / "hf2")).rope_parameters
    assert (
        rope == transformers.LlamaConfig.from_pretrained(str(tmp_path / "hf")).rope_parameters == LLAMA3_ROPE
    )
    ours = load_pretrained(tmp_path / "nl")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2")).eval()
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(ours(ids), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(reloaded(ids).logits, want)
    save_pretrained(ours, tmp_path / "nl2")  # the model's own config.json (as a training step's)
    convert_nanolight_to_hf(tmp_path / "nl2", tmp_path / "hf3")
    assert transformers.LlamaConfig.from_pretrained(str(tmp_path / "hf3")).rope_parameters == rope


def test_autotokenizer_loads_a_llama3_nanolight_directory(tmp_path):
    """transformers' AutoTokenizer reads the directory's config.json as a bare config, which fails
    on a ``rope_scaling`` key: the directory keeps it under its own name, and a directory written
    before (the plain key) still reads the same config."""
    make_hf(tmp_path / "hf", rope_parameters=dict(LLAMA3_ROPE), max_position_embeddings=131072)
    convert_hf_to_nanolight(tmp_path / "hf", tmp_path / "nl")
    assert_tokenizer_works(tmp_path / "nl")
    written = json.loads((tmp_path / "nl" / "config.json").read_text())
    config = LlamaConfig.from_dict(written)
    assert config.rope_scaling["factor"] == LLAMA3_ROPE["factor"] and "rope_scaling" not in written
    legacy = {k: v for k, v in written.items() if k != DIRECTORY_ROPE_KEY} | {
        "rope_scaling": config.rope_scaling
    }
    assert LlamaConfig.from_dict(legacy) == config


def test_save_and_load_pretrained_round_trip(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.preset("smollm-tiny", num_hidden_layers=1, vocab_size=256))
    make_hf(tmp_path / "tok")
    save_pretrained(model, tmp_path / "ck", tokenizer_dir=tmp_path / "tok")
    loaded = load_pretrained(tmp_path / "ck")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model.eval()(ids))
    assert_tokenizer_works(tmp_path / "ck")
    with pytest.raises(FileExistsError, match="--overwrite"):
        save_pretrained(model, tmp_path / "ck")
    save_pretrained(model, tmp_path / "ck", overwrite=True)
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------- bad input
def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _wrong_shape(path: Path) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(81, 48)
    save_file(tensors, str(path / "model.safetensors"))


BAD_HF = {
    "missing": (lambda p: None, FileNotFoundError, "does not exist"),
    "architecture": (
        lambda p: _edit_config(p, architectures=["MistralForCausalLM"], model_type="mistral"),
        ValueError,
        r"unsupported architecture \['MistralForCausalLM'\].*LlamaForCausalLM \(model_type 'llama'\)",
    ),
    "wrong-shape": (_wrong_shape, ValueError, r"model.layers.1.mlp.up_proj.weight has shape \(81, 48\)"),
    "attention-bias": (lambda p: _edit_config(p, attention_bias=True), ValueError, "attention_bias=true"),
    "mlp-bias": (lambda p: _edit_config(p, mlp_bias=True), ValueError, "mlp_bias=true"),
    "rope-type": (
        lambda p: _edit_config(p, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
        ValueError,
        "rope_scaling type 'yarn'.*supports 'default' and 'llama3'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_HF))
def test_bad_hf_input_fails_cleanly(tmp_path, case):
    corrupt, error, message = BAD_HF[case]
    src = tmp_path / ("nowhere" if case == "missing" else "hf")
    if case != "missing":
        make_hf(src)
        corrupt(src)
    with pytest.raises(error, match=message):
        convert_hf_to_nanolight(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_save_path_holding_another_model_is_refused_unless_overwrite(tmp_path):
    make_hf(tmp_path / "hf")
    make_hf(tmp_path / "other", num_key_value_heads=3)
    convert_hf_to_nanolight(tmp_path / "other", tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(FileExistsError, match="already holds files .*--overwrite"):
        convert_hf_to_nanolight(tmp_path / "hf", tmp_path / "out")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    convert_hf_to_nanolight(tmp_path / "hf", tmp_path / "out", overwrite=True)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 2
    assert leftovers(tmp_path) == []


def test_nanolight_to_hf_rejects_a_hf_directory(tmp_path):
    make_hf(tmp_path / "hf")
    with pytest.raises(ValueError, match="not a nanolight checkpoint.*convert_hf_to_nanolight"):
        convert_nanolight_to_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- the scripts
def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_scripts_work_under_torchrun_env_and_fail_with_message(tmp_path):
    """One success (with the variables torchrun sets) and one failure: each subprocess costs ~4 s."""
    make_hf(tmp_path / "hf")
    torchrun_env = dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511"
    )
    args = ("--checkpoint-path", str(tmp_path / "hf"), "--save-path", str(tmp_path / "nl"))
    ok = _run("convert_hf_to_nanolight.py", *args, **torchrun_env)
    assert ok.returncode == 0, ok.stderr
    assert_tokenizer_works(tmp_path / "nl")

    bad = _run(
        "convert_nanolight_to_hf.py",
        "--checkpoint-path",
        str(tmp_path / "nope"),
        "--save-path",
        str(tmp_path / "x"),
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: checkpoint path") and "does not exist" in bad.stderr
    assert not (tmp_path / "x").exists() and leftovers(tmp_path) == []


def test_hub_ids_resolve_through_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub

    make_hf(tmp_path / "hf")
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append(repo_id)
        if repo_id != "HuggingFaceTB/SmolLM-135M":
            raise RuntimeError("404 repository not found")
        return str(tmp_path / "hf")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    convert_hf_to_nanolight("HuggingFaceTB/SmolLM-135M", tmp_path / "nl")
    assert calls == ["HuggingFaceTB/SmolLM-135M"] and (tmp_path / "nl" / "model.safetensors").is_file()
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a downloadable Hub model id"):
        convert_hf_to_nanolight("no-such-org/no-such-model", tmp_path / "nl2")
    assert not (tmp_path / "nl2").exists()


def test_load_pretrained_takes_what_the_converter_takes(tmp_path):
    """`last` (the pointer file), the checkpoints directory and the run's root resolve to the newest
    step, for `load_pretrained` as for the converter: one resolver."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BASE, num_key_value_heads=2)).eval()
    run = tmp_path / "run"
    save_pretrained(model, run / "checkpoints" / "step-3")
    (run / "checkpoints" / "last").write_text("step-3\n")
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        ref = model(ids)
        for where in (run / "checkpoints" / "last", run / "checkpoints", run, str(run)):
            torch.testing.assert_close(load_pretrained(where)(ids), ref)
    out = convert_nanolight_to_hf(run, tmp_path / "hf")
    assert (out / "model.safetensors").is_file()
