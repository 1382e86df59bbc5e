"""executor.model / moe / data / reference on one process: shapes, weights, routing, the ground truth."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from executor.data import SyntheticTokens, TokenFile, split_batch
from executor.layers import rope_cos_sin
from executor.model import build_model, count_params, full_state_dict, init_weights
from executor.moe import MoE
from executor.reference import lm_loss, reference_run
from planner.contracts import ModelSpec, MoESpec
from planner.cost.params import total_params
from planner.errors import AutoparError
from planner.presets import get_preset

TINY = ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=128, vocab_size=128)
TINY_MOE = TINY.model_copy(update={"moe": MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=32,
                                                  num_shared_experts=1)})


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def built(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    m = build_model(spec, device="cpu")
    init_weights(m, seed)
    return m


@pytest.mark.parametrize("spec", [
    TINY, TINY_MOE, TINY.model_copy(update={"tied_embeddings": True}),
    TINY.model_copy(update={"ffn_kind": "gelu", "norm": "layernorm", "linear_bias": True}),
    TINY.model_copy(update={"norm": "layernorm", "num_kv_heads": 1, "head_dim": 8}),
])
def test_parameter_count_equals_the_planners(spec):
    assert count_params(built(spec)) == total_params(spec)


def test_meta_model_has_shapes_only_and_presets_build():
    m = build_model(get_preset("llama3-8b"))
    assert all(p.is_meta for p in m.parameters())
    assert count_params(m) == total_params(get_preset("llama3-8b"))


def test_weights_depend_on_seed_and_name_not_on_construction():
    a, b = built(TINY, 3), built(TINY, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    full = full_state_dict(TINY, 3)
    assert all(torch.equal(full[k], v) for k, v in a.state_dict().items())
    assert not torch.equal(full["layers.0.attention.wq.weight"], full["layers.1.attention.wq.weight"])
    assert not torch.equal(full_state_dict(TINY, 4)["tok_embeddings.weight"], full["tok_embeddings.weight"])
    assert torch.equal(full["norm.weight"], torch.ones(64))
    # residual projections are scaled by 1/sqrt(2L)
    assert full["layers.0.attention.wo.weight"].std() < 0.6 * full["layers.0.attention.wq.weight"].std()


def test_causal_and_positions_drive_rope():
    m = built(TINY)
    x = torch.randint(0, 128, (2, 16))
    full = m(x)
    assert full.shape == (2, 16, 128)
    # causal: the first 8 logits do not depend on later tokens
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 1) % 128
    assert torch.allclose(m(y)[:, :8], full[:, :8], atol=1e-6)
    # explicit positions equal the default; RoPE is relative: a shift changes nothing, spreading
    # the positions apart (other distances between the rows) does
    assert torch.allclose(m(x, torch.arange(16)), full)
    assert torch.allclose(m(x, torch.arange(16) + 5), full, atol=1e-5)
    assert not torch.allclose(m(x, 3 * torch.arange(16)), full, atol=1e-3)


def test_pipeline_stage_shapes_hidden_in_hidden_out():
    m = built(TINY)
    x = torch.randint(0, 128, (2, 8))
    first = built(TINY)
    del first.layers["1"]
    first.norm, first.output = None, None  # no head: hidden states out
    last = built(TINY)
    del last.layers["0"]
    last.tok_embeddings = None
    assert torch.allclose(last(first(x)), m(x), atol=1e-6)


@pytest.mark.parametrize("field,value", [("position_embedding", "learned"), ("dropout", 0.1)])
def test_unsupported_spec_fields_are_named(field, value):
    extra = {"max_position_embeddings": 64} if value == "learned" else {}
    spec = TINY.model_copy(update={field: value, **extra})
    with pytest.raises(AutoparError, match=field):
        build_model(spec)


def test_mla_is_refused_by_name():
    with pytest.raises(AutoparError, match="model.mla"):
        build_model(get_preset("deepseek-v3"))


def test_rope_theta_and_positions_of_a_shard():
    spec = TINY.model_copy(update={"num_layers": 1})
    a, b = build_model(spec, device="cpu"), build_model(spec, device="cpu", rope_theta=500_000.0)
    init_weights(a, 0)
    init_weights(b, 0)
    x = torch.randint(0, 128, (1, 16))
    assert not torch.allclose(a(x), b(x), atol=1e-4)
    # the angles of arbitrary (non-contiguous) positions are the rows of the contiguous table
    cos, sin = rope_cos_sin(torch.tensor([3, 9, 4]), 16)
    cos_all, sin_all = rope_cos_sin(torch.arange(10), 16)
    assert torch.allclose(cos, cos_all[[3, 9, 4]]) and torch.allclose(sin, sin_all[[3, 9, 4]])


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over its top-k experts of weight x expert(x), plus the shared experts."""
    ids, weights, _ = moe.route(x)
    e = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            k = int(ids[t, j])
            out[t] += weights[t, j] * e.run(x[t:t + 1], e.w1[k], e.w2[k], e.w3[k], e.kind)[0]
        for s in range(moe.shared_experts.w1.shape[0]):
            sh = moe.shared_experts
            out[t] += sh.run(x[t:t + 1], sh.w1[s], sh.w2[s], sh.w3[s], sh.kind)[0]
    return out


def test_moe_dropless_equals_token_by_token_and_aux_loss_by_hand():
    m = built(TINY_MOE)
    moe = m.layers["0"].moe
    x = torch.randn(24, 64)
    y = moe(x[None])[0]
    assert torch.allclose(y, naive_moe(moe, x), atol=1e-6)
    ids, weights, probs = moe.route(x)
    assert torch.allclose(weights.sum(-1), torch.ones(24))
    f = torch.bincount(ids.reshape(-1), minlength=8).float() / ids.numel()
    assert torch.allclose(moe.aux_loss, 0.01 * 8 * (f * probs.mean(0)).sum())


def test_moe_capacity_drops_late_assignments_first_come_first_served():
    spec = TINY_MOE.model_copy(update={"moe": TINY_MOE.moe.model_copy(update={"capacity_factor": 0.5,
                                                                              "num_shared_experts": 0})})
    moe = built(spec).layers["0"].moe
    x = torch.randn(32, 64)
    ids, weights, _ = moe.route(x)
    capacity = math.ceil(0.5 * 32 * 2 / 8)
    keep = moe._keep_mask(ids)
    seen: dict[int, int] = {}
    for t in range(32):
        for j in range(2):
            k = int(ids[t, j])
            seen[k] = seen.get(k, 0) + 1
            assert bool(keep[t, j]) == (seen[k] <= capacity)
    assert not keep.all()
    e = moe.experts
    expect = torch.zeros_like(x)
    for t in range(32):
        for j in range(2):
            if keep[t, j]:
                k = int(ids[t, j])
                expect[t] += weights[t, j] * e.run(x[t:t + 1], e.w1[k], e.w2[k], e.w3[k], e.kind)[0]
    assert torch.allclose(moe(x[None])[0], expect, atol=1e-6)


def test_gradient_accumulation_equals_one_big_batch():
    data = SyntheticTokens(128, 16, seed=1)
    a, b = built(TINY_MOE), built(TINY_MOE)
    ra = reference_run(a, data, steps=1, global_batch=8, micro_batch_size=8)
    rb = reference_run(b, data, steps=1, global_batch=8, micro_batch_size=2, aux_loss=False)
    ra2 = reference_run(built(TINY_MOE), data, steps=1, global_batch=8, micro_batch_size=8, aux_loss=False)
    assert ra.losses[0] > ra2.losses[0]  # the aux loss is added
    assert abs(ra2.losses[0] - rb.losses[0]) < 1e-5
    for k, g in ra2.grads_first_step.items():
        assert torch.allclose(g, rb.grads_first_step[k], atol=1e-6), k


def test_reference_builds_a_spec_with_its_seed_and_checks_the_micro_batch():
    data = SyntheticTokens(128, 16, seed=1)
    from_spec = reference_run(TINY, data, steps=2, global_batch=4, micro_batch_size=2, seed=5)
    from_model = reference_run(built(TINY, 5), data, steps=2, global_batch=4, micro_batch_size=2)
    assert from_spec.losses == from_model.losses
    with pytest.raises(AutoparError, match="micro_batch_size"):
        reference_run(TINY, data, steps=1, global_batch=4, micro_batch_size=3)


def test_loss_falls_on_synthetic_tokens():
    data = SyntheticTokens(128, 32, seed=0)
    r = reference_run(built(TINY), data, steps=30, global_batch=8, micro_batch_size=4, lr=3e-3)
    assert r.losses[0] > math.log(128) - 0.3
    assert r.losses[-1] < r.losses[0] - 1.0


def test_lm_loss_is_the_mean_when_divided_by_the_count():
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    assert torch.allclose(lm_loss(logits, targets, 10), ref)


def test_data_is_deterministic_and_splits_by_rank(tmp_path):
    data = SyntheticTokens(100, 8, seed=2)
    assert torch.equal(data.batch(3, 8), SyntheticTokens(100, 8, seed=2).batch(3, 8))
    assert not torch.equal(data.batch(3, 8), data.batch(4, 8))
    parts = [split_batch(data.batch(0, 8), r, 2, 2) for r in range(2)]
    assert torch.equal(torch.cat([torch.cat(p) for p in parts]), data.batch(0, 8))
    with pytest.raises(AutoparError, match="global_batch_size"):
        split_batch(data.batch(0, 6), 0, 4, 1)
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    tf = TokenFile(path, 8, vocab_size=1000)
    assert tf.batch(0, 2).tolist()[1][:3] == [9, 10, 11]
    with pytest.raises(AutoparError, match="vocab_size"):
        TokenFile(path, 8, vocab_size=500)
    with pytest.raises(AutoparError, match="does not exist"):
        TokenFile(tmp_path / "missing.bin", 8, 1000)
    with pytest.raises(AutoparError, match="fewer than one sequence"):
        TokenFile(path, 2000, vocab_size=1000)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 1001)
    with pytest.raises(AutoparError, match="uint16"):
        TokenFile(odd, 8, vocab_size=1000)
    with pytest.raises(AutoparError, match="data-dtype"):
        TokenFile(path, 8, vocab_size=1000, dtype="int8")


def test_grouped_attention_is_causal_softmax_and_keeps_no_expanded_kv():
    """attention_core against the formula (query head h reads kv head h // group), and what autograd
    keeps for the backward: K/V at their own kv heads, as the planner's activation memory counts them
    (expanded beforehand they were kept 4x here)."""
    from executor.layers import attention_core

    torch.manual_seed(0)
    b, h, kv, s, d = 2, 8, 2, 24, 16
    q = torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv, s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv, s, d, dtype=torch.float64, requires_grad=True)
    kk, vv = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
    scores = (q @ kk.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    want = scores.softmax(-1) @ vv
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        got = attention_core(q, k, v)
    torch.testing.assert_close(got, want)
    kv_shaped = [t for t in saved if t.dim() == 4 and t.shape[1] in (kv, h) and t.shape[-1] == d and t.shape[2] == s]
    assert any(t.shape[1] == kv for t in kv_shaped), [tuple(t.shape) for t in saved]
    assert not any(t.shape == (b, h, s, d) and t.data_ptr() not in (q.data_ptr(), got.data_ptr()) for t in kv_shaped), \
        [tuple(t.shape) for t in saved]
    # and the gradients are the formula's
    got.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want.sum().backward()
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad)


def test_attention_reads_the_dtype_autocast_runs_sdpa_in():
    """bf16 plans train under autocast, where RoPE's fp32 tables turn q and k to fp32 before SDPA: the
    grouped-kernel rule must read autocast's dtype (bf16, which CUDA's flash kernel takes), not q's."""
    from executor.layers import _runs_sixteen_bit, attention_core

    q = torch.randn(1, 4, 8, 16)
    assert not _runs_sixteen_bit(q) and _runs_sixteen_bit(q.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _runs_sixteen_bit(q)
        k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16).bfloat16()
        out = attention_core(q, k, v)
    assert out.shape == (1, 4, 8, 16) and out.dtype == torch.bfloat16


def test_the_attention_kernels_benchmark_prints_both_ways():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "attention_kernels.py"), "--reps", "1"],
                       capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith(("bfloat16", "float32"))]
    assert len(rows) == 6 and all(row[7] == "grouped" and float(row[4]) > 0 and float(row[5]) > 0 for row in rows)
