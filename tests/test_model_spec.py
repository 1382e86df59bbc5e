"""ModelSpec validation: every rejection names the field and the offending value."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from planner.contracts.model import MLASpec, ModelSpec, MoESpec


def spec(**changes: Any) -> ModelSpec:
    """A small valid Llama-style spec with ``changes`` applied."""
    fields: dict[str, Any] = {
        "num_layers": 4,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_kv_heads": 8,
        "ffn_hidden_size": 14336,
        "vocab_size": 32000,
    }
    return ModelSpec(**(fields | changes))


def rejected(**changes: Any) -> str:
    with pytest.raises(ValidationError) as info:
        spec(**changes)
    return str(info.value)


def test_valid_spec_and_derived_shapes() -> None:
    m = spec()
    assert (m.kv_heads, m.head_size, m.value_head_size, m.num_moe_layers) == (8, 128, 128, 0)
    assert spec(num_kv_heads=None).kv_heads == 32


def test_heads_not_dividing_hidden() -> None:
    message = rejected(num_attention_heads=30, num_kv_heads=None)
    assert "num_attention_heads=30" in message and "hidden_size=4096" in message


def test_explicit_head_dim_allows_non_dividing_heads() -> None:
    m = spec(hidden_size=5140, num_attention_heads=40, num_kv_heads=None, head_dim=128)
    assert m.head_size == 128


@pytest.mark.parametrize("kv", [5, 64])
def test_kv_heads_must_divide_heads(kv: int) -> None:
    message = rejected(num_kv_heads=kv)
    assert f"num_kv_heads={kv}" in message and "num_attention_heads=32" in message


def test_top_k_above_num_experts() -> None:
    message = rejected(moe={"num_experts": 8, "top_k": 9, "expert_ffn_hidden_size": 1024})
    assert "moe.top_k=9" in message and "moe.num_experts=8" in message
    with pytest.raises(ValidationError, match="moe.top_k=9"):
        MoESpec(num_experts=8, top_k=9, expert_ffn_hidden_size=1024)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_layers", 0),
        ("num_layers", -1),
        ("hidden_size", 0),
        ("hidden_size", -4096),
        ("num_attention_heads", 0),
        ("ffn_hidden_size", 0),
        ("vocab_size", -5),
        ("num_kv_heads", 0),
        ("head_dim", -128),
    ],
)
def test_non_positive_sizes(field: str, value: int) -> None:
    message = rejected(**{field: value})
    assert f"{field}={value}" in message and "positive" in message


@pytest.mark.parametrize(
    ("moe", "named"),
    [
        ({"num_experts": 0, "top_k": 1, "expert_ffn_hidden_size": 1024}, "moe.num_experts=0"),
        ({"num_experts": 8, "top_k": 0, "expert_ffn_hidden_size": 1024}, "moe.top_k=0"),
        ({"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": -1}, "moe.expert_ffn_hidden_size=-1"),
    ],
)
def test_non_positive_moe_sizes(moe: dict[str, int], named: str) -> None:
    assert named in rejected(moe=moe)


def test_negative_shared_experts() -> None:
    moe = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 1024, "num_shared_experts": -1}
    message = rejected(moe=moe)
    assert "num_shared_experts" in message and "-1" in message


def test_non_positive_mla_sizes() -> None:
    mla = {"kv_lora_rank": 0, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    assert "mla.kv_lora_rank=0" in rejected(mla=mla)
    with pytest.raises(ValidationError, match="mla.v_head_dim=-1"):
        MLASpec(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=-1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", 10**9),
        ("num_layers", 10**6),
        ("num_attention_heads", 10**5),
        ("ffn_hidden_size", 10**8),
        ("vocab_size", 10**9),
    ],
)
def test_absurd_sizes(field: str, value: int) -> None:
    message = rejected(**{field: value})
    assert f"{field}={value}" in message and "larger than" in message


def test_unknown_field_rejected() -> None:
    message = rejected(num_layer=32)  # typo of num_layers
    assert "num_layer" in message and "32" in message and "Extra inputs are not permitted" in message


def test_unknown_moe_field_rejected() -> None:
    message = rejected(moe={"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 1024, "topk": 2})
    assert "topk" in message and "Extra inputs are not permitted" in message


def test_learned_positions_need_a_table_size() -> None:
    message = rejected(position_embedding="learned")
    assert "position_embedding='learned'" in message and "max_position_embeddings" in message
    assert spec(position_embedding="learned", max_position_embeddings=2048).max_position_embeddings == 2048


def test_first_dense_layers_must_leave_a_moe_layer() -> None:
    moe = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 1024, "first_dense_layers": 4}
    message = rejected(moe=moe)
    assert "moe.first_dense_layers=4" in message and "num_layers=4" in message


def test_dropout_range() -> None:
    assert "dropout" in rejected(dropout=1.0)
    assert "dropout" in rejected(dropout=-0.1)


def test_assignment_is_validated() -> None:
    m = spec()
    with pytest.raises(ValidationError, match="hidden_size=0"):
        m.hidden_size = 0


def test_moe_layer_placement() -> None:
    moe = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 1024, "first_dense_layers": 1,
           "layer_frequency": 2}  # fmt: skip
    m = spec(num_layers=6, moe=moe)
    assert [m.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    assert m.num_moe_layers == 3


@pytest.mark.parametrize("name", ["", "   ", "\t"])
def test_a_blank_name_is_refused(name: str) -> None:
    """An empty model name printed as ' on dgx-h100 (8 GPUs)'; a profile's or device's likewise."""
    assert "is blank; give a name" in rejected(name=name)
    from planner.reference import reference_profile

    profile = reference_profile("dgx-h100", 1)
    for change in ({"name": name}, {"device": profile.device.model_dump() | {"name": name}}):  # cluster, device
        with pytest.raises(ValidationError, match="is blank; give a name"):
            type(profile).model_validate(profile.model_dump() | change)
