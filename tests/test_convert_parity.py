"""Converted checkpoints compute what transformers' LlamaForCausalLM computes (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers

from nanolight.models.pretrained import convert_hf_to_nanolight, load_pretrained

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIGS = {
    "mha-untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "gqa-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "mqa-untied": dict(num_key_value_heads=1, tie_word_embeddings=False),
    "rope-theta": dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    # T=80 below > original_max_position_embeddings=64; with head_dim 16 the wavelengths fall in all
    # three llama3 bands (kept < 16, blended 16..64, divided by factor > 64).
    "llama3-rope": dict(num_key_value_heads=2, rope_parameters=LLAMA3, max_position_embeddings=128),
    "odd-sizes": dict(
        vocab_size=1001,
        hidden_size=72,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
    ),
}


def make_hf(tmp_path, **overrides) -> tuple[transformers.LlamaForCausalLM, str]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**BASE, "rms_norm_eps": 1e-5, **overrides})
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits norms to 1; perturb them so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path / "hf")
    model.save_pretrained(path)
    return model, path


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_loss_match_transformers(tmp_path, name):
    hf, hf_dir = make_hf(tmp_path, **CONFIGS[name])
    convert_hf_to_nanolight(hf_dir, tmp_path / "nl")
    model = load_pretrained(tmp_path / "nl")
    assert not model.training
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (2, 80), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, :7] = -100
    with torch.no_grad():
        ref = hf(ids, labels=labels)
        logits = model(ids)
        loss = model(ids, labels=labels)
    assert logits.shape == (2, 80, vocab)
    assert rel_err(logits, ref.logits) < 1e-5
    assert abs(loss.item() - ref.loss.item()) / ref.loss.item() < 1e-5


def test_eager_matches_transformers_eager(tmp_path):
    hf, hf_dir = make_hf(tmp_path, num_key_value_heads=2)
    hf.config._attn_implementation = "eager"
    convert_hf_to_nanolight(hf_dir, tmp_path / "nl")
    eager = load_pretrained(tmp_path / "nl", attn_implementation="eager")
    sdpa = load_pretrained(tmp_path / "nl")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(eager(ids), hf(ids).logits) < 1e-5
        assert rel_err(eager(ids), sdpa(ids)) < 1e-5


def test_gradients_flow_through_converted_model(tmp_path):
    hf, hf_dir = make_hf(tmp_path, num_key_value_heads=2, tie_word_embeddings=True)
    convert_hf_to_nanolight(hf_dir, tmp_path / "nl")
    model = load_pretrained(tmp_path / "nl").train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).backward()
    hf.train()
    hf(ids, labels=ids).loss.backward()
    # the tied embedding receives gradient from both the lookup and the output head, as in HF
    torch.testing.assert_close(
        model.model.embed_tokens.weight.grad, hf.model.embed_tokens.weight.grad, rtol=1e-4, atol=1e-6
    )
    # fused qkv gradient = HF's q/k/v gradients in the grouped layout
    g = model.model.layers[0].self_attn.qkv_proj.weight.grad.view(2, 4, 16, 64)  # (n_kv, r+2, hd, C)
    torch.testing.assert_close(
        g[:, 2].reshape(32, 64), hf.model.layers[0].self_attn.k_proj.weight.grad, rtol=1e-4, atol=1e-6
    )
