"""The Llama model on its own: config validation, presets, meta build + init, attention choice, FLOPs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import nanolight.models.attention as attention
import nanolight.models.llama as llama
from nanolight.models import PRESETS, LlamaConfig, LlamaForCausalLM, flops_per_token
from nanolight.models.llama_config import matmul_params, num_params

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"


def tiny(**kw) -> LlamaConfig:
    base = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaConfig(**{**base, **kw})


# ---------------------------------------------------------------------- config
def test_head_dim_is_derived_and_kv_heads_default():
    c = LlamaConfig(
        vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4
    )
    assert c.head_dim == 16 and c.num_key_value_heads == 4


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_key_value_heads=3), "must be a multiple of num_key_value_heads"),
        (dict(hidden_size=66), "set head_dim explicitly"),
        (dict(head_dim=15), "must be even"),
        (dict(attn_implementation="flex"), "choose one of sdpa, flash_attention_2, eager"),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
            "rope_scaling type 'yarn' is not supported",
        ),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "missing low_freq_factor"),
        (dict(vocab_size=0), "vocab_size must be a positive integer"),
    ],
)
def test_config_validation_says_what_to_fix(kw, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kw)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="smollm-tiny, smollm-135m"):
        LlamaConfig.preset("smollm-7b")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_yaml_matches_dataclass(name):
    data = yaml.safe_load((CONF_DIR / f"{name}.yaml").read_text())
    assert data == PRESETS[name]
    assert LlamaConfig(**data) == LlamaConfig.preset(name)


def test_hydra_composed_preset_builds_and_unknown_keys_are_named():
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(CONF_DIR / "smollm-tiny.yaml")
    cfg.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    cfg.rope_scaling.high_freq_factor = 4.0
    cfg.rope_scaling.original_max_position_embeddings = 256
    c = LlamaConfig.from_dict(cfg, strict=True)
    assert type(c.rope_scaling) is dict and c.rms_norm_eps == 1e-5
    with pytest.raises(ValueError, match="unknown model config key.*'hiden_size'.*valid keys: vocab_size"):
        LlamaConfig.from_dict({**PRESETS["smollm-tiny"], "hiden_size": 3}, strict=True)


def test_smollm_parameter_counts():
    # Published SmolLM sizes: 134.5M / 361.8M / 1.71B parameters (tied embeddings).
    assert num_params(LlamaConfig.preset("smollm-135m")) == 134_515_008
    assert num_params(LlamaConfig.preset("smollm-360m")) == 361_821_120
    assert num_params(LlamaConfig.preset("smollm-1.7b")) == 1_711_376_384
    with torch.device("meta"):
        m = LlamaForCausalLM(LlamaConfig.preset("smollm-135m"))
    assert m.num_parameters() == 134_515_008


def test_hf_config_legacy_and_v5_rope_keys():
    legacy = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=10,
        hidden_size=32,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    c = LlamaConfig.from_hf(legacy)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3"
    v5 = {**legacy, "rope_parameters": {**legacy.pop("rope_scaling"), "rope_theta": 500000.0}}
    v5.pop("rope_theta")
    assert LlamaConfig.from_hf(v5) == c
    assert LlamaConfig.from_hf(c.to_hf_dict()) == c


# ---------------------------------------------------------------------- build, init, forward
def test_meta_build_then_init_is_deterministic_and_tied():
    cfg = tiny(tie_word_embeddings=True)
    models = []
    for _ in range(2):
        with torch.device("meta"):
            m = LlamaForCausalLM(cfg)
        assert m.lm_head.weight.is_meta
        m.to_empty(device="cpu")
        assert m.lm_head.weight is m.model.embed_tokens.weight  # to_empty re-ties
        torch.manual_seed(1234)
        m.init_weights()
        models.append(m)
    for (n, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters(), strict=True):
        assert torch.equal(a, b), n
    m = models[0]
    assert torch.equal(m.model.norm.weight, torch.ones(64))
    assert torch.equal(m.model.layers[1].input_layernorm.weight, torch.ones(64))
    std = m.model.layers[0].mlp.gate_up_proj.weight.std().item()
    assert abs(std - cfg.initializer_range) < 0.002
    assert m(torch.randint(0, 97, (2, 5))).shape == (2, 5, 97)


def test_init_draws_gate_up_unit_by_unit():
    """The init stream is what it was when gate_up's rows were stored interleaved per unit (each
    parameter drawn whole, in order): a seed gives the same weights, stored [gate | up]."""
    torch.manual_seed(7)
    m = LlamaForCausalLM(tiny())
    torch.manual_seed(7)
    for name, p in m.named_parameters():
        drawn = torch.ones_like(p) if name.endswith("norm.weight") else torch.empty_like(p).normal_(0, 0.02)
        if name.endswith("gate_up_proj.weight"):  # rows [g0, u0, g1, u1, ...] as drawn
            drawn = torch.cat((drawn[0::2], drawn[1::2]))
        assert torch.equal(p, drawn), name


def test_direct_build_equals_meta_build_plus_init():
    torch.manual_seed(3)
    direct = LlamaForCausalLM(tiny(tie_word_embeddings=True))
    with torch.device("meta"):
        meta = LlamaForCausalLM(tiny(tie_word_embeddings=True))
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    for (n, a), (_, b) in zip(direct.named_parameters(), meta.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert direct.lm_head.weight is direct.model.embed_tokens.weight


def test_init_param_on_full_tensors_reproduces_init_weights():
    """What a TP strategy does: draw each FULL tensor via init_param in order, then slice it."""
    with torch.device("meta"):
        m = LlamaForCausalLM(tiny())
    m.to_empty(device="cpu")
    m.init_weights(torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    for name, p in m.named_parameters():
        full = torch.empty(p.shape)
        m.init_param(name, full, g)
        assert torch.equal(full, p), name


def test_tp_plan_names_real_modules():
    m = LlamaForCausalLM(tiny())
    names = {n for n, _ in m.named_modules()}
    for pattern in LlamaForCausalLM.tp_plan:
        assert any(n == pattern.replace("*", "0") for n in names), pattern


def test_loss_is_mean_over_shifted_tokens_and_ignores_minus_100():
    torch.manual_seed(0)
    m = LlamaForCausalLM(tiny()).eval()
    ids = torch.randint(0, 97, (2, 9))
    labels = ids.clone()
    labels[0, 3:6] = -100
    logits = m(ids)
    keep = labels[:, 1:] != -100
    expected = torch.nn.functional.cross_entropy(logits[:, :-1][keep], labels[:, 1:][keep])
    torch.testing.assert_close(m(ids, labels=labels), expected)


def test_eager_and_sdpa_agree_and_position_ids_default():
    torch.manual_seed(0)
    cfg = tiny(num_key_value_heads=1)
    sdpa = LlamaForCausalLM(cfg).eval()
    eager = LlamaForCausalLM(tiny(num_key_value_heads=1, attn_implementation="eager")).eval()
    eager.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 97, (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(ids), eager(ids), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sdpa(ids), sdpa(ids, position_ids=torch.arange(11)))


def test_flash_attention_needs_package_and_gpu(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs the flash-attn package and a CUDA GPU"):
        LlamaForCausalLM(tiny(attn_implementation="flash_attention_2"))
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    with torch.device("meta"):
        m = LlamaForCausalLM(tiny(attn_implementation="flash_attention_2"))
    assert m.model.layers[0].self_attn.attn_implementation == "flash_attention_2"


class RecordingAttention:
    """An attention backend written from PyTorch's own op (SDPA on kv heads repeated per group,
    documents as a dense mask built here), recording which layer's call it served."""

    name = "recording-sdpa"

    def __init__(self) -> None:
        self.prepared: list[torch.Tensor] = []
        self.calls: list[tuple[int, ...]] = []

    def prepare(self, documents: attention.Documents) -> attention.Documents:
        self.prepared.append(documents.ids)
        return documents

    def attend(self, q, k, v, documents):  # noqa: ANN001, ANN201
        self.calls.append(tuple(q.shape))
        r = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        mask = None
        if documents is not None:
            ids, T = documents.ids, q.size(2)
            mask = (ids[:, :, None] == ids[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
            mask = mask[:, None]
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None
        )


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_injected_attention_backend_serves_every_layer(implementation: str) -> None:
    """A backend set on the built model is what every layer calls (and what prepares packed
    documents, once per forward); the default, built from the config's name, gives the same logits."""
    torch.manual_seed(0)
    cfg = tiny(num_hidden_layers=3, attn_implementation=implementation)
    model = LlamaForCausalLM(cfg).eval()
    default = model.attention_backend
    assert isinstance(default, attention.KernelAttention) and default.name == implementation
    assert all(layer.self_attn.attention_backend is default for layer in model.model.layers)
    ids = torch.randint(0, 97, (2, 13))
    docs = torch.tensor([[0] * 5 + [1] * 8, [0] * 13])
    with torch.no_grad():
        before = model(ids), model(ids, document_ids=docs)
        backend = RecordingAttention()
        model.set_attention_backend(backend)
        after = model(ids), model(ids, document_ids=docs)
    assert model.attention_backend is backend
    assert all(layer.self_attn.attention_backend is backend for layer in model.model.layers)
    assert all(layer.self_attn.attn_implementation == "recording-sdpa" for layer in model.model.layers)
    assert backend.calls == [(2, 4, 13, 16)] * 6  # 3 layers, two forwards
    assert len(backend.prepared) == 1 and backend.prepared[0] is docs  # once, for the packed forward
    for ours, reference in zip(before, after, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="needs an object with name, prepare"):
        model.set_attention_backend(lambda q, k, v: q)


def test_sharded_modules_run_unchanged():
    """A tp rank holding half the kv groups and half the MLP units runs the same forward code."""
    torch.manual_seed(0)
    cfg = tiny()
    layer = llama.DecoderLayer(cfg)
    attn, mlp = layer.self_attn, layer.mlp
    x = torch.randn(2, 5, 64)
    cos, sin = llama.rope_cos_sin(torch.arange(5).expand(2, 5), llama.rope_inv_freq(16, 1e4, None), x.dtype)
    full_attn = attn(x, cos, sin)
    full_mlp = mlp(x)
    rows_qkv = attn.qkv_proj.weight.shape[0] // 2
    gate, up = mlp.gate_up_proj.weight.chunk(2)  # [gate | up]: a rank holds half of each
    parts_attn, parts_mlp = [], []
    for rank in range(2):
        a = llama.CausalSelfAttention(cfg)
        a.qkv_proj.weight.data = attn.qkv_proj.weight[rank * rows_qkv : (rank + 1) * rows_qkv]
        a.o_proj.weight.data = attn.o_proj.weight[:, rank * 32 : (rank + 1) * 32]
        parts_attn.append(a(x, cos, sin))  # row-parallel o_proj: partial sums
        mm = llama.SwiGLU(cfg)
        mm.gate_up_proj.weight.data = torch.cat((gate.chunk(2)[rank], up.chunk(2)[rank]))
        mm.down_proj.weight.data = mlp.down_proj.weight[:, rank * 48 : (rank + 1) * 48]
        parts_mlp.append(mm(x))
    torch.testing.assert_close(sum(parts_attn), full_attn, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sum(parts_mlp), full_mlp, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- FLOPs
def test_flops_per_token_hand_count():
    c = tiny(tie_word_embeddings=True)  # C=64, I=96, L=2, heads 4 x 16, kv 2, V=97
    per_layer = 64 * (4 * 16 + 2 * 2 * 16) + 64 * 64 + 3 * 64 * 96  # qkv + o + gate/up/down
    n = 2 * per_layer + 64 * 97  # + lm_head (counted although tied)
    assert matmul_params(c) == n == 2 * (8192 + 4096 + 18432) + 6208
    assert flops_per_token(c, 128) == 6 * n + 12 * 2 * 128 * 16 * 4
