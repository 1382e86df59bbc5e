"""Hugging Face config.json -> ModelSpec: field mapping for each layout and errors that name the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from planner.cost.params import total_params
from planner.errors import AutoparError, UnknownNameError
from planner.hf_config import SUPPORTED_MODEL_TYPES, model_spec_from_hf_config
from planner.presets import get_preset

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "config.json").read_text())


# ---- mapping ----


@pytest.mark.parametrize(
    ("fixture", "preset"),
    [
        ("llama-3.1-8b", "llama3.1-8b"),
        ("mixtral-8x7b-v0.1", "mixtral-8x7b"),
        ("qwen3-30b-a3b", "qwen3-30b-a3b"),
        ("deepseek-v3", "deepseek-v3"),
    ],
)
def test_fixture_matches_preset(fixture: str, preset: str) -> None:
    spec = model_spec_from_hf_config(FIXTURES / fixture / "config.json")
    assert spec.model_dump(exclude={"name"}) == get_preset(preset).model_dump(exclude={"name"})


def test_llama() -> None:
    spec = model_spec_from_hf_config(FIXTURES / "llama-3.1-8b" / "config.json")
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.kv_heads) == (32, 4096, 32, 8)
    assert (spec.ffn_hidden_size, spec.vocab_size, spec.head_size) == (14336, 128256, 128)
    assert spec.ffn_kind == "swiglu" and spec.norm == "rmsnorm" and spec.position_embedding == "rope"
    assert not spec.tied_embeddings and not spec.linear_bias and spec.moe is None and spec.mla is None


def test_mistral() -> None:
    spec = model_spec_from_hf_config(FIXTURES / "mistral-7b-v0.1" / "config.json")
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.kv_heads) == (32, 4096, 32, 8)
    assert (spec.ffn_hidden_size, spec.vocab_size) == (14336, 32000)
    assert spec.moe is None and not spec.tied_embeddings


@pytest.mark.parametrize(
    ("fixture", "shape", "tied", "adds"),
    [  # (layers, hidden, heads, kv heads, head size, ffn, vocab); what the family adds, priced
        ("gemma-2-9b", (42, 3584, 16, 8, 256, 14336, 256000), True,
         {"sliding_window": 4096, "global_layer_every": 2, "extra_norms": 2, "logit_softcap": 30.0}),
        ("olmo-2-7b", (32, 4096, 32, 32, 128, 11008, 100352), False, {"qk_norm": True}),
        ("granite-3.0-8b", (40, 4096, 32, 8, 128, 12800, 49155), True, {}),
        ("phi-3-mini", (32, 3072, 32, 32, 96, 8192, 32064), False, {}),
        ("mistral-7b-v0.1", (32, 4096, 32, 8, 128, 14336, 32000), False, {"sliding_window": 4096}),
    ],
)
def test_llama_like_families(fixture: str, shape: tuple, tied: bool, adds: dict) -> None:
    """Gemma 2 (gated GELU read as the gated MLP, tied by default, a window on every second block, two
    extra norms, soft-capped logits), OLMo 2 (q/k norms), Granite (scalars, not modelled), Phi-3 (fused
    projections: the same shapes), Mistral 7B v0.1 (a window on every block)."""
    spec = model_spec_from_hf_config(FIXTURES / fixture / "config.json")
    got = (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.head_size,
           spec.ffn_hidden_size, spec.vocab_size)
    assert got == shape and spec.tied_embeddings is tied and spec.ffn_kind == "swiglu" and spec.moe is None
    defaults = {"sliding_window": None, "global_layer_every": None, "extra_norms": 0, "qk_norm": False,
                "logit_softcap": None}
    assert {k: getattr(spec, k) for k in defaults} == defaults | adds


def test_gemma_activation_is_checked() -> None:
    cfg = load("gemma-2-9b") | {"hidden_activation": "relu"}
    with pytest.raises(AutoparError, match=r"hidden_activation='relu'.*gelu_pytorch_tanh"):
        model_spec_from_hf_config(cfg)
    gemma3 = model_spec_from_hf_config(load("gemma-2-9b") | {"model_type": "gemma3_text", "sliding_window": 1024})
    assert gemma3.tied_embeddings and gemma3.qk_norm and (gemma3.sliding_window, gemma3.global_layer_every) == (1024, 6)
    assert [gemma3.is_windowed_layer(i) for i in range(7)] == [True] * 5 + [False, True]


def test_qwen2() -> None:
    spec = model_spec_from_hf_config(FIXTURES / "qwen2-7b" / "config.json")
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.kv_heads) == (28, 3584, 28, 4)
    assert (spec.ffn_hidden_size, spec.vocab_size, spec.head_size) == (18944, 152064, 128)
    assert spec.qkv_bias and not spec.linear_bias  # Qwen2 biases Q, K and V only
    assert total_params(spec) - total_params(spec.model_copy(update={"qkv_bias": False})) == 28 * (28 + 2 * 4) * 128
    llama = load("llama-3.1-8b")
    assert model_spec_from_hf_config(llama | {"attention_bias": True}).qkv_bias
    assert model_spec_from_hf_config(llama | {"attention_bias": True, "mlp_bias": True}).linear_bias
    assert not model_spec_from_hf_config(llama).qkv_bias


def test_qwen3_dense_head_dim() -> None:
    spec = model_spec_from_hf_config(FIXTURES / "qwen3-8b" / "config.json")
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.kv_heads) == (36, 4096, 32, 8)
    assert (spec.head_dim, spec.ffn_hidden_size, spec.vocab_size) == (128, 12288, 151936)


def test_mixtral() -> None:
    spec = model_spec_from_hf_config(FIXTURES / "mixtral-8x7b-v0.1" / "config.json")
    assert spec.moe is not None
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.expert_ffn_hidden_size) == (8, 2, 14336)
    assert spec.moe.num_shared_experts == 0 and spec.num_moe_layers == 32


def test_qwen3_moe() -> None:
    spec = model_spec_from_hf_config(FIXTURES / "qwen3-30b-a3b" / "config.json")
    assert spec.moe is not None
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.expert_ffn_hidden_size) == (128, 8, 768)
    assert (spec.head_size, spec.kv_heads, spec.ffn_hidden_size, spec.num_moe_layers) == (128, 4, 6144, 48)


def test_deepseek_v3() -> None:
    spec = model_spec_from_hf_config(FIXTURES / "deepseek-v3" / "config.json")
    assert spec.moe is not None and spec.mla is not None
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.num_shared_experts) == (256, 8, 1)
    assert (spec.moe.expert_ffn_hidden_size, spec.moe.first_dense_layers) == (2048, 3)
    assert spec.num_moe_layers == 58
    assert (spec.mla.q_lora_rank, spec.mla.kv_lora_rank) == (1536, 512)
    assert (spec.mla.qk_nope_head_dim, spec.mla.qk_rope_head_dim, spec.mla.v_head_dim) == (128, 64, 128)
    assert (spec.ffn_hidden_size, spec.kv_heads, spec.vocab_size) == (18432, 128, 129280)


def test_deepseek_null_q_lora_rank_means_uncompressed() -> None:
    cfg = load("deepseek-v3") | {"q_lora_rank": None}
    spec = model_spec_from_hf_config(cfg)
    assert spec.mla is not None and spec.mla.q_lora_rank == 0


def test_dict_path_string_and_folder_agree() -> None:
    folder = FIXTURES / "qwen3-8b"
    specs = [
        model_spec_from_hf_config(load("qwen3-8b")),
        model_spec_from_hf_config(str(folder / "config.json")),
        model_spec_from_hf_config(folder / "config.json"),
        model_spec_from_hf_config(folder),
    ]
    assert all(s == specs[0] for s in specs)


def test_name_defaults() -> None:
    cfg = load("mistral-7b-v0.1")
    assert model_spec_from_hf_config(cfg).name == "mistral"
    cfg["_name_or_path"] = "mistralai/Mistral-7B-v0.1"
    assert model_spec_from_hf_config(cfg).name == "mistralai/Mistral-7B-v0.1"
    assert model_spec_from_hf_config(cfg, name="my-mistral").name == "my-mistral"


def test_defaults_for_optional_keys() -> None:
    cfg = load("llama-3.1-8b")
    for key in ("num_key_value_heads", "tie_word_embeddings", "hidden_act"):
        del cfg[key]
    spec = model_spec_from_hf_config(cfg)
    assert spec.kv_heads == 32 and not spec.tied_embeddings and spec.ffn_kind == "swiglu"
    assert model_spec_from_hf_config(load("llama-3.1-8b") | {"tie_word_embeddings": True}).tied_embeddings


def test_qwen3_moe_leading_dense_layers() -> None:
    spec = model_spec_from_hf_config(load("qwen3-30b-a3b") | {"mlp_only_layers": [1, 0, 2]})
    assert spec.moe is not None and spec.moe.first_dense_layers == 3 and spec.num_moe_layers == 45


@pytest.mark.parametrize(("step", "dense"), [(2, []), (3, []), (2, [0, 1]), (4, [0, 1, 2, 3, 4])])
def test_qwen3_moe_sparse_step_follows_transformers_rule(step: int, dense: list[int]) -> None:
    cfg = load("qwen3-30b-a3b") | {"decoder_sparse_step": step, "mlp_only_layers": dense}
    spec = model_spec_from_hf_config(cfg)
    for i in range(spec.num_layers):  # transformers' Qwen3MoeDecoderLayer rule
        assert spec.is_moe_layer(i) == (i not in dense and (i + 1) % step == 0), i


@pytest.mark.parametrize(("freq", "k"), [(1, 0), (2, 3), (3, 1), (2, 0)])
def test_deepseek_layer_freq_follows_modeling_rule(freq: int, k: int) -> None:
    cfg = load("deepseek-v3") | {"moe_layer_freq": freq, "first_k_dense_replace": k}
    spec = model_spec_from_hf_config(cfg)
    for i in range(spec.num_layers):  # DeepseekV3DecoderLayer rule
        assert spec.is_moe_layer(i) == (i >= k and i % freq == 0), i


# ---- errors ----


def test_unsupported_model_type() -> None:
    with pytest.raises(UnknownNameError) as info:
        model_spec_from_hf_config(FIXTURES / "gpt2" / "config.json")
    err = info.value
    assert err.field == "model_type" and err.value == "gpt2"
    assert sorted(err.known) == sorted(SUPPORTED_MODEL_TYPES)
    message = str(err)
    assert "gpt2" in message and "supported" in message
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in message


def test_missing_model_type() -> None:
    cfg = load("llama-3.1-8b")
    del cfg["model_type"]
    with pytest.raises(UnknownNameError, match="model_type=None") as info:
        model_spec_from_hf_config(cfg)
    assert "llama" in str(info.value)


@pytest.mark.parametrize(
    ("fixture", "key"),
    [
        ("llama-3.1-8b", "hidden_size"),
        ("llama-3.1-8b", "num_hidden_layers"),
        ("qwen2-7b", "vocab_size"),
        ("mistral-7b-v0.1", "intermediate_size"),
        ("mixtral-8x7b-v0.1", "num_local_experts"),
        ("qwen3-30b-a3b", "moe_intermediate_size"),
        ("qwen3-30b-a3b", "num_experts"),
        ("deepseek-v3", "kv_lora_rank"),
        ("deepseek-v3", "n_routed_experts"),
    ],
)
def test_missing_key_is_named(fixture: str, key: str) -> None:
    cfg = load(fixture)
    del cfg[key]
    with pytest.raises(AutoparError) as info:
        model_spec_from_hf_config(cfg)
    assert info.value.field == f"config.json:{key}"
    assert f"config.json:{key}" in str(info.value) and "missing" in str(info.value)


def test_missing_key_in_file_names_file_and_key(tmp_path: Path) -> None:
    cfg = load("llama-3.1-8b")
    del cfg["hidden_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(AutoparError, match="config.json:hidden_size"):
        model_spec_from_hf_config(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "config.json"
    with pytest.raises(AutoparError) as info:
        model_spec_from_hf_config(path)
    assert str(path) in str(info.value) and "does not exist" in str(info.value)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(AutoparError, match="does not exist"):
        model_spec_from_hf_config(tmp_path)


def test_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", ')
    with pytest.raises(AutoparError) as info:
        model_spec_from_hf_config(path)
    assert str(path) in str(info.value) and "JSON" in str(info.value)


def test_json_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(AutoparError) as info:
        model_spec_from_hf_config(path)
    assert str(path) in str(info.value) and "not an object" in str(info.value)


def test_heads_not_dividing_hidden_names_the_field() -> None:
    cfg = load("llama-3.1-8b") | {"num_attention_heads": 30, "num_key_value_heads": 10}
    with pytest.raises(AutoparError) as info:
        model_spec_from_hf_config(cfg)
    err = info.value
    assert err.field == "config.json:num_attention_heads" and err.value == 30
    assert "num_attention_heads=30" in str(err) and "4096" in str(err)


def test_a_deepseek_config_without_moe_layers_is_a_dense_mla_model() -> None:
    """first_k_dense_replace >= num_hidden_layers: transformers builds every layer dense, and so does the plan."""
    spec = model_spec_from_hf_config(load("deepseek-v3") | {"first_k_dense_replace": 61})
    assert spec.moe is None and spec.mla is not None and spec.num_layers == 61


@pytest.mark.parametrize(
    ("fixture", "change", "key"),
    [
        ("llama-3.1-8b", {"num_key_value_heads": 5}, "num_key_value_heads"),
        ("llama-3.1-8b", {"hidden_size": 0}, "hidden_size"),
        ("llama-3.1-8b", {"vocab_size": 10**9}, "vocab_size"),
        ("qwen2-7b", {"num_hidden_layers": -4}, "num_hidden_layers"),
        ("mixtral-8x7b-v0.1", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen3-30b-a3b", {"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ("deepseek-v3", {"n_shared_experts": -1}, "n_shared_experts"),
        ("deepseek-v3", {"v_head_dim": 0}, "v_head_dim"),
    ],
)
def test_invalid_value_names_the_config_key(fixture: str, change: dict[str, int], key: str) -> None:
    with pytest.raises(AutoparError) as info:
        model_spec_from_hf_config(load(fixture) | change)
    assert info.value.field == f"config.json:{key}"
    assert info.value.value == change[key]
    assert f"config.json:{key}={change[key]!r}" in str(info.value)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"hidden_size": "4096"}, "hidden_size"),
        ({"hidden_size": 4096.0}, "hidden_size"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ],
)
def test_wrong_json_type_names_the_key(change: dict[str, object], key: str) -> None:
    with pytest.raises(AutoparError) as info:
        model_spec_from_hf_config(load("llama-3.1-8b") | change)
    assert info.value.field == f"config.json:{key}"


def test_non_silu_activation_rejected() -> None:
    with pytest.raises(AutoparError) as info:
        model_spec_from_hf_config(load("mistral-7b-v0.1") | {"hidden_act": "gelu"})
    assert info.value.field == "config.json:hidden_act" and "gelu" in str(info.value)


def test_qwen3_moe_interleaved_dense_layers_rejected() -> None:
    with pytest.raises(AutoparError) as info:
        model_spec_from_hf_config(load("qwen3-30b-a3b") | {"mlp_only_layers": [0, 5]})
    assert info.value.field == "config.json:mlp_only_layers"
    assert "leading" in str(info.value)


def test_qwen3_moe_all_layers_dense_rejected() -> None:
    with pytest.raises(AutoparError) as info:
        model_spec_from_hf_config(load("qwen3-30b-a3b") | {"mlp_only_layers": list(range(48))})
    assert info.value.field == "config.json:mlp_only_layers" and "no MoE layer" in str(info.value)


@pytest.mark.parametrize(
    ("fixture", "change", "key"),
    [
        ("qwen3-30b-a3b", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("deepseek-v3", {"moe_layer_freq": 0}, "moe_layer_freq"),
        ("deepseek-v3", {"first_k_dense_replace": -1}, "first_k_dense_replace"),
        ("qwen3-30b-a3b", {"mlp_only_layers": "0,1"}, "mlp_only_layers"),
    ],
)
def test_bad_layer_pattern_names_the_key(fixture: str, change: dict[str, object], key: str) -> None:
    with pytest.raises(AutoparError) as info:
        model_spec_from_hf_config(load(fixture) | change)
    assert info.value.field == f"config.json:{key}"
