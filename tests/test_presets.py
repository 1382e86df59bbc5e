"""Model presets: every one validates, parameter counts match the published totals, lookup is forgiving."""

from __future__ import annotations

import pytest

from planner.contracts.model import ModelSpec
from planner.errors import UnknownNameError
from planner.presets import ALIASES, PRESETS, _squash, get_preset, list_presets


def count_params(m: ModelSpec) -> int:
    """Weights of a ModelSpec, counted from its shapes (test-local; not the cost model's counter)."""
    h = m.hidden_size
    bias = int(m.linear_bias)
    norm = (2 if m.norm == "layernorm" else 1) * h  # LayerNorm has a scale and a shift
    total = m.vocab_size * h * (1 if m.tied_embeddings else 2) + norm  # embedding, LM head, final norm
    if m.position_embedding == "learned":
        total += (m.max_position_embeddings or 0) * h

    a = m.num_attention_heads
    if m.mla is not None:
        mla = m.mla
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank:
            q = h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * a * qk  # down, norm, up
        else:
            q = h * a * qk
        kv = (
            h * (mla.kv_lora_rank + mla.qk_rope_head_dim)  # latent + shared rotary key
            + mla.kv_lora_rank  # latent norm
            + mla.kv_lora_rank * a * (mla.qk_nope_head_dim + mla.v_head_dim)  # up-projection to K and V
        )
        attn = q + kv + a * mla.v_head_dim * h
    else:
        d, k = m.head_size, m.kv_heads
        attn = h * (a + 2 * k) * d + a * d * h + bias * ((a + 2 * k) * d + h)

    def mlp(f: int) -> int:
        if m.ffn_kind == "swiglu":
            return 3 * h * f + bias * (2 * f + h)
        return 2 * h * f + bias * (f + h)

    for i in range(m.num_layers):
        total += attn + 2 * norm
        if m.is_moe_layer(i):
            assert m.moe is not None
            total += m.moe.num_experts * (mlp(m.moe.expert_ffn_hidden_size) + h)  # experts and router
            total += m.moe.num_shared_experts * mlp(m.moe.shared_ffn)
        else:
            total += mlp(m.ffn_hidden_size)
    return total


# ---- every preset is a valid contract ----


@pytest.mark.parametrize("name", list_presets())
def test_preset_validates_and_round_trips(name: str) -> None:
    spec = get_preset(name)
    assert spec.name == name
    again = ModelSpec.model_validate_json(spec.model_dump_json())
    assert again == spec
    assert count_params(spec) > 1e9


def test_list_presets_is_sorted_and_complete() -> None:
    names = list_presets()
    assert names == sorted(names) == sorted(PRESETS)
    expected = {
        "gpt3-1.3b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b",
        "megatron-22b", "megatron-175b", "megatron-530b", "megatron-1t",
        "llama2-7b", "llama2-13b", "llama2-70b",
        "llama3-8b", "llama3.1-8b", "llama3-70b", "llama3.1-70b", "llama3.1-405b",
        "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3",
    }  # fmt: skip
    assert set(names) == expected
    assert all(n == n.lower() for n in names)


def test_lookup_keys_do_not_collide() -> None:
    keys = [_squash(n) for n in [*PRESETS, *ALIASES]]
    assert len(keys) == len(set(keys))


# ---- parameter sanity against hand arithmetic and published totals ----


def test_llama31_8b_by_hand() -> None:
    h, v, layers, kv_dim, ffn = 4096, 128256, 32, 8 * 128, 14336
    embeddings = 2 * v * h  # untied input embedding and LM head
    attention = h * h + 2 * h * kv_dim + h * h  # q, k, v (8 KV heads of 128), o
    mlp = 3 * h * ffn  # gate, up, down
    norms = 2 * h
    total = embeddings + layers * (attention + mlp + norms) + h
    assert total == 8_030_261_248
    assert count_params(get_preset("llama3.1-8b")) == total


def test_llama31_70b_by_hand() -> None:
    h, v, layers, kv_dim, ffn = 8192, 128256, 80, 8 * 128, 28672
    total = 2 * v * h + layers * (2 * h * h + 2 * h * kv_dim + 3 * h * ffn + 2 * h) + h
    assert total == pytest.approx(70.55e9, rel=1e-3)
    assert count_params(get_preset("llama3.1-70b")) == total


def test_llama31_405b_by_hand() -> None:
    h, v, layers, kv_dim, ffn = 16384, 128256, 126, 8 * 128, 53248
    total = 2 * v * h + layers * (2 * h * h + 2 * h * kv_dim + 3 * h * ffn + 2 * h) + h
    assert total == pytest.approx(405.85e9, rel=1e-3)
    assert count_params(get_preset("llama3.1-405b")) == total


def test_gpt3_175b_by_hand() -> None:
    h, v, layers, positions = 12288, 50257, 96, 2048
    per_layer = 12 * h * h + 13 * h  # qkv+o (4h^2), MLP 4h (8h^2); biases 9h, two LayerNorms 4h
    total = v * h + positions * h + layers * per_layer + 2 * h  # tied LM head, final LayerNorm
    assert total == pytest.approx(174.6e9, rel=1e-3)
    assert count_params(get_preset("gpt3-175b")) == total


@pytest.mark.parametrize(
    ("name", "billions", "rel"),
    [
        ("llama2-7b", 6.74, 2e-3),  # Touvron et al. 2023
        ("llama2-13b", 13.02, 2e-3),
        ("llama2-70b", 68.98, 2e-3),
        ("llama3-8b", 8.03, 2e-3),
        ("gpt3-1.3b", 1.3, 0.02),  # Brown et al. 2020 rounds to one decimal
        ("gpt3-6.7b", 6.7, 0.02),
        ("gpt3-13b", 13.0, 0.02),
        ("megatron-22b", 22.0, 0.02),  # Korthikanti et al. 2022, Table 3
        ("megatron-175b", 175.0, 0.01),
        ("megatron-530b", 530.0, 0.01),
        ("megatron-1t", 1008.0, 0.01),
        ("mixtral-8x7b", 46.7, 2e-3),  # Jiang et al. 2024
        ("qwen3-30b-a3b", 30.5, 5e-3),  # Qwen3 report (q/k norms not counted)
        ("deepseek-v3", 671.0, 2e-3),  # DeepSeek-V3 report: 671B without the MTP module
    ],
)
def test_published_totals(name: str, billions: float, rel: float) -> None:
    assert count_params(get_preset(name)) == pytest.approx(billions * 1e9, rel=rel)


def test_moe_and_mla_shapes() -> None:
    ds = get_preset("deepseek-v3")
    assert ds.moe is not None and ds.mla is not None
    assert ds.num_moe_layers == 58 and not ds.is_moe_layer(2) and ds.is_moe_layer(3)
    assert ds.head_size == 192 and ds.value_head_size == 128 and ds.kv_heads == 128
    qwen = get_preset("qwen3-30b-a3b")
    assert qwen.head_size == 128 and qwen.kv_heads == 4 and qwen.num_moe_layers == 48
    assert qwen.moe is not None and qwen.moe.num_shared_experts == 0 and not qwen.tied_embeddings
    mixtral = get_preset("mixtral-8x7b")
    assert mixtral.moe is not None and (mixtral.moe.num_experts, mixtral.moe.top_k) == (8, 2)
    assert get_preset("gpt3-13b").head_size == 128


# ---- lookup ----


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("Llama-3.1-405B", "llama3.1-405b"),
        ("llama3.1_405b", "llama3.1-405b"),
        ("LLAMA3.1_405B", "llama3.1-405b"),
        ("meta-llama/Llama-3.1-8B", "llama3.1-8b"),
        ("meta-llama/Meta-Llama-3-70B", "llama3-70b"),
        ("llama3-405b", "llama3.1-405b"),
        ("Llama-2-7b", "llama2-7b"),
        ("  gpt3_175b ", "gpt3-175b"),
        ("GPT3-1.3B", "gpt3-1.3b"),
        ("gpt3-13B", "gpt3-13b"),
        ("Mixtral-8x7B", "mixtral-8x7b"),
        ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
        ("DeepSeek_V3", "deepseek-v3"),
        ("Megatron-1T", "megatron-1t"),
    ],
)
def test_name_normalisation(given: str, canonical: str) -> None:
    assert get_preset(given).name == canonical


def test_unknown_name_lists_known_presets() -> None:
    with pytest.raises(UnknownNameError) as info:
        get_preset("llama4-9000b")
    err = info.value
    assert err.field == "model" and err.value == "llama4-9000b"
    assert err.known == list_presets()
    message = str(err)
    assert "llama4-9000b" in message
    for name in ("llama3.1-8b", "gpt3-175b", "deepseek-v3"):
        assert name in message


def test_get_preset_returns_fresh_copy() -> None:
    first = get_preset("mixtral-8x7b")
    first.num_layers = 2
    assert first.moe is not None
    first.moe.top_k = 1
    second = get_preset("mixtral-8x7b")
    assert second is not first and second.moe is not first.moe
    assert second.num_layers == 32 and second.moe is not None and second.moe.top_k == 2
    assert PRESETS["mixtral-8x7b"].num_layers == 32
