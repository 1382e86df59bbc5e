"""executor.hf / executor.adapters: tiny Hugging Face decoders from config dicts (nothing fetched)."""

from __future__ import annotations

import json

import pytest
import torch

from executor.adapters import builtin_adapter, get_submodule
from executor.hf import build_hf_model, check_parallelisable, hf_adapter
from executor.model import build_model
from planner.contracts import ModelSpec, MoESpec
from planner.cost.params import total_params
from planner.errors import AutoparError
from planner.hf_config import model_spec_from_hf_config

BASE = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "tie_word_embeddings": False}
CONFIGS = {
    "llama": {"model_type": "llama", **BASE},
    "mistral": {"model_type": "mistral", **BASE},
    "qwen2": {"model_type": "qwen2", **BASE},
    "qwen3": {"model_type": "qwen3", "head_dim": 8, **BASE},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, **BASE},
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, **BASE},
}


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def unmodelled_params(name: str) -> int:
    """Weights the planner leaves out on purpose (planner/hf_config.py): Qwen2's Q/K/V biases and
    Qwen3's per-head q/k RMSNorms, per layer."""
    heads, kv, layers = 4, 2, 2
    if name == "qwen2":
        return layers * (heads + 2 * kv) * 8
    if name in ("qwen3", "qwen3_moe"):
        return layers * 2 * 8
    return 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_builds_trains_and_matches_the_planners_parameter_count(name):
    config = CONFIGS[name]
    model = build_hf_model(config, seed=0)
    check_parallelisable(model)
    tokens = torch.randint(0, 128, (2, 12))
    logits = model(tokens).logits
    assert logits.shape == (2, 12, 128)
    torch.nn.functional.cross_entropy(logits.reshape(-1, 128), tokens.reshape(-1)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    spec = model_spec_from_hf_config(config)
    assert sum(p.numel() for p in model.parameters()) == total_params(spec) + unmodelled_params(name)


def test_weights_depend_only_on_the_seed_and_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a = build_hf_model(CONFIGS["llama"], seed=1).state_dict()
    assert torch.equal(torch.random.get_rng_state(), state)
    b = build_hf_model(CONFIGS["llama"], seed=1).state_dict()
    c = build_hf_model(CONFIGS["llama"], seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    with torch.device("meta"):
        assert all(p.is_meta for p in build_hf_model(CONFIGS["mixtral"]).parameters())


def test_config_file_and_dtype(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIGS["mistral"], "architectures": ["MistralForCausalLM"]}))
    model = build_hf_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(AutoparError, match="does not exist"):
        build_hf_model(tmp_path / "missing.json")


def test_unsupported_model_type_names_it_and_the_supported_list():
    with pytest.raises(AutoparError, match="gpt2") as err:
        build_hf_model({"model_type": "gpt2", "n_layer": 2})
    assert "llama" in str(err.value) and "mixtral" in str(err.value)


def test_check_parallelisable_names_the_missing_module():
    model = build_hf_model(CONFIGS["llama"])
    del model.model.layers[1].self_attn.q_proj
    with pytest.raises(AutoparError, match=r"model\.layers\.1\.self_attn\.q_proj"):
        check_parallelisable(model)
    model = build_hf_model(CONFIGS["qwen2"])
    model.model.layers[0].mlp.up_proj = torch.nn.Identity()
    with pytest.raises(AutoparError, match=r"layers\.0\.mlp\.up_proj.*Linear"):
        check_parallelisable(model)


def test_adapters_point_at_the_same_parts_in_both_families():
    hf = build_hf_model(CONFIGS["mixtral"])
    a = hf_adapter(hf)
    assert get_submodule(hf, a.embedding) is hf.model.embed_tokens
    layers = dict(a.layer_items(hf))
    assert list(layers) == ["0", "1"] and all(a.is_moe(layer) for layer in layers.values())
    assert get_submodule(a.attention_of(layers["0"]), a.q_proj) is hf.model.layers[0].self_attn.q_proj

    spec = ModelSpec(name="t", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                     ffn_hidden_size=64, vocab_size=128, tied_embeddings=True,
                     moe=MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=16, first_dense_layers=1))
    model = build_model(spec)
    b = builtin_adapter(model)
    assert b.lm_head is None and get_submodule(model, b.final_norm) is model.norm
    built_layers = dict(b.layer_items(model))
    assert [b.is_moe(layer) for layer in built_layers.values()] == [False, True]
    ffn = b.ffn_of(built_layers["0"])
    assert get_submodule(ffn, b.up_proj) is model.layers["0"].feed_forward.w3
    assert get_submodule(b.attention_of(built_layers["1"]), b.o_proj) is model.layers["1"].attention.wo
