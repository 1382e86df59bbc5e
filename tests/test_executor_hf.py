"""executor.hf / executor.adapters: tiny Hugging Face decoders from config dicts (nothing fetched); every
supported family under FSDP, HSDP, TP+SP and TP x FSDP (4 gloo ranks, tests/dist_scripts/hf_grads_check.py)
against the single-process gradients, parameter by parameter."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from executor.adapters import HF, builtin_adapter, get_submodule, norm_width
from executor.data import SyntheticTokens
from executor.hf import build_hf_model, check_parallelisable, hf_adapter
from executor.model import build_model
from executor.parallelize import check_supported
from executor.reference import reference_run
from planner.contracts import ModelSpec, MoESpec, ParallelLayout
from planner.cost.params import total_params
from planner.errors import AutoparError
from planner.hf_config import model_spec_from_hf_config

SCRIPT = Path(__file__).parent / "dist_scripts" / "hf_grads_check.py"
_spec = importlib.util.spec_from_file_location("hf_grads_check", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)
CONFIGS = check.CONFIGS  # one tiny config per supported family
# |dist - ref| <= GRAD_TOLERANCE x max|ref|, every element of every parameter's gradient (fp32: the
# reduction order moves it by ~1e-7 relative; a gradient reduced over the wrong ranks is off by ~1)
GRAD_TOLERANCE = 1e-4


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def unmodelled_params(name: str) -> int:
    """Weights the planner leaves out on purpose (planner/hf_config.py), per layer: the per-head q/k RMSNorms
    of Qwen3 and Gemma 3, OLMo 2's whole-projection q/k norms, Gemma's two extra residual norms (Qwen2's
    Q/K/V biases are counted: ``qkv_bias``)."""
    hidden, head, heads, kv, layers = 32, 8, 4, 2, 2
    per_layer = {"qwen3": 2 * head, "qwen3_moe": 2 * head,
                 "olmo2": (heads + kv) * head, "gemma2": 2 * hidden, "gemma3": 2 * hidden + 2 * head}
    return layers * per_layer.get(name, 0)


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


def test_any_model_type_transformers_builds_is_accepted_and_bad_ones_are_named():
    with pytest.raises(AutoparError, match=r"model_type='no_such_model'.*not known to transformers"):
        build_hf_model({"model_type": "no_such_model"})
    with pytest.raises(AutoparError, match=r"model_type=None.*missing"):
        build_hf_model({"hidden_size": 32})
    with pytest.raises(AutoparError, match=r"model_type='t5'.*cannot be built as a causal LM"):
        build_hf_model({"model_type": "t5"})
    with pytest.raises(AutoparError, match=r"model_type='phi3'.*cannot be built"):  # pad id outside the vocab
        build_hf_model({**CONFIGS["phi3"], "pad_token_id": 1000})
    gpt2 = build_hf_model({"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 64})
    with pytest.raises(AutoparError, match=r"GPT2LMHeadModel\.model\.embed_tokens='missing'"):
        check_parallelisable(gpt2)  # a decoder of another module layout: refused by what it lacks


def test_context_parallelism_is_refused_for_attention_sinks_only():
    cp2 = ParallelLayout(cp=2, dp_shard=2, zero_stage=3)
    sinks = build_hf_model({**CONFIGS["llama"], "model_type": "gpt_oss", "head_dim": 8,
                            "num_local_experts": 4, "num_experts_per_tok": 2, "layer_types": None})
    with pytest.raises(AutoparError, match=r"layout\.cp=2 cannot run its attention: GptOssAttention\.sinks"):
        check_parallelisable(sinks, cp2)  # (the planner does not read gpt_oss configs yet: the module check)
    for family in ("gemma2", "gemma3", "olmo2", "mixtral"):  # soft-capped scores, windows, row q/k norms, MoE: run
        check_supported(cp2, build_hf_model(CONFIGS[family]))


def test_cp_attention_soft_caps_the_scores_as_gemma_2_does():
    """On one rank (a group of one) the CP attention with ``softcap`` equals softmax(c·tanh(s/c)) v by hand."""
    import torch.distributed as dist

    from executor.cp import cp_attention

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 6, 4, generator=g) * 3 for _ in range(3))
        got = cp_attention(q, k, v, positions=torch.arange(6), group=dist.group.WORLD, scale=0.5, softcap=2.0)
        scores = torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 2.0) * 2.0
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
        assert torch.allclose(got, torch.softmax(scores, -1) @ v, atol=1e-6)
        plain = cp_attention(q, k, v, positions=torch.arange(6), group=dist.group.WORLD, scale=0.5)
        assert not torch.allclose(got, plain, atol=1e-3)  # the cap matters at these magnitudes
    finally:
        dist.destroy_process_group()


def test_expert_parallelism_is_decided_from_the_experts_module():
    ep2 = ParallelLayout(dp_shard=4, ep=2)
    for family in ("mixtral", "qwen3_moe", "deepseek_v3"):
        check_supported(ep2, build_hf_model(CONFIGS[family]))
    model = build_hf_model(CONFIGS["mixtral"])
    experts = model.model.layers[1].mlp.experts
    experts.down_proj_bias = torch.nn.Parameter(torch.zeros(4, 32))  # an experts layout of another kind
    with pytest.raises(AutoparError, match=r"layout\.ep=2 cannot dispatch .*layers\.1\.mlp\.experts.*down_proj_bias"):
        check_supported(ep2, model)


def test_moe_families_and_latent_attention_take_tensor_parallelism_with_whole_experts():
    tp2 = ParallelLayout(dp_shard=2, tp=2, sp=True, etp=1)
    for family in ("mixtral", "qwen3_moe", "deepseek_v3"):
        check_supported(tp2, build_hf_model(CONFIGS[family]))
    model = build_hf_model(CONFIGS["deepseek_v3"])
    with pytest.raises(AutoparError, match=r"layout\.tp=8 .*divides the 4 attention heads"):
        check_parallelisable(model, ParallelLayout(tp=8, sp=True, etp=1))
    model.model.layers[0].self_attn.extra = torch.nn.Linear(4, 4)  # a weighted module the plan does not place
    with pytest.raises(AutoparError, match=r"layout\.tp=2 cannot place .*self_attn\.extra \(Linear\)"):
        check_parallelisable(model, tp2)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # SDPA, and eager with its explicit masks
def test_selective_recompute_reruns_the_attention_core_of_the_chosen_layers_only(monkeypatch, family):
    import executor.hf_selective as selective
    from executor.parallelize import apply_recompute
    from planner.contracts import Recompute, StageRecompute

    calls: list[torch.nn.Module] = []
    real = selective.inner_attention

    def counting(attention):
        fn = real(attention)
        return lambda *args, **kwargs: calls.append(attention) or fn(*args, **kwargs)

    monkeypatch.setattr(selective, "inner_attention", counting)
    model = build_hf_model(CONFIGS[family])
    tokens = torch.randint(0, 128, (2, 12))
    reference = build_hf_model(CONFIGS[family])(tokens).logits
    apply_recompute(model, StageRecompute(kind=Recompute.selective, num_layers=1), ParallelLayout())
    logits = model(tokens).logits
    assert torch.allclose(logits, reference, atol=1e-6)  # the model's own masks still apply
    logits.sum().backward()
    first, second = (layer.self_attn for layer in model.model.layers)
    assert calls.count(first) == 2 and calls.count(second) == 1  # forward, and again in the backward


def test_gemma2_falls_back_to_eager_attention():
    model = build_hf_model(CONFIGS["gemma2"])
    assert model.config._attn_implementation == "eager"  # transformers has no SDPA path for its soft-capping
    assert build_hf_model(CONFIGS["llama"]).config._attn_implementation == "sdpa"


def test_tensor_parallelism_is_decided_from_the_modules():
    tp2 = ParallelLayout(dp_shard=2, tp=2, sp=True)
    phi3 = build_hf_model(CONFIGS["phi3"])
    check_parallelisable(phi3, ParallelLayout(dp_shard=4, zero_stage=3))
    with pytest.raises(AutoparError, match=r"layout\.tp=2 cannot split .*layers\.0\.self_attn\.qkv_proj.*fuses"):
        check_parallelisable(phi3, tp2)
    with pytest.raises(AutoparError, match=r"qkv_proj"):
        check_supported(tp2, phi3)
    olmo2, qwen3 = build_hf_model(CONFIGS["olmo2"]), build_hf_model(CONFIGS["qwen3"])
    for model, expected in ((olmo2, "row"), (qwen3, "head")):
        attention = model.model.layers[0].self_attn
        assert norm_width(attention, attention.q_norm, HF) == expected
        assert norm_width(attention, attention.k_norm, HF) == expected
        check_parallelisable(model, tp2)
    olmo2.model.layers[1].self_attn.q_norm = torch.nn.LayerNorm(12)
    with pytest.raises(AutoparError, match=r"layers\.1\.self_attn\.q_norm \(LayerNorm\)"):
        check_parallelisable(olmo2, tp2)


def test_check_parallelisable_names_the_missing_module():
    tp2 = ParallelLayout(dp_shard=2, tp=2, sp=True)
    model = build_hf_model(CONFIGS["llama"])
    del model.model.layers[1].self_attn.q_proj
    check_parallelisable(model)  # without TP the projections are not split: nothing needs them by name
    with pytest.raises(AutoparError, match=r"model\.layers\.1\.self_attn\.q_proj='missing'.*tp=2 needs it"):
        check_parallelisable(model, tp2)
    model = build_hf_model(CONFIGS["qwen2"])
    model.model.layers[0].mlp.up_proj = torch.nn.Identity()
    with pytest.raises(AutoparError, match=r"layers\.0\.mlp\.up_proj.*Linear"):
        check_parallelisable(model, tp2)
    del model.model.layers[0].self_attn
    with pytest.raises(AutoparError, match=r"layers\.0\.self_attn='missing'"):
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


# ---------------------------------------------------------------- torchrun, 4 ranks
def relative_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """max|got - ref| / max|ref| per parameter (0 where both are zero)."""
    errors = {}
    for name, r in ref.items():
        scale = r.abs().max().item()
        diff = (got[name] - r).abs().max().item()
        errors[name] = diff / scale if scale else (0.0 if diff == 0 else float("inf"))
    return errors


def gradient_mismatches(out: Path, family: str, plan: str) -> list[str]:
    """One line per (rank, parameter) whose gradient is off by more than GRAD_TOLERANCE."""
    gbs = check.global_batch(ParallelLayout(**check.PLANS[plan]))
    ref = reference_run(build_hf_model(CONFIGS[family], seed=check.SEED),
                        SyntheticTokens(check.BASE["vocab_size"], check.SEQ, check.SEED), steps=1,
                        global_batch=gbs, micro_batch_size=check.MBS).grads_first_step
    lines = []
    for rank in range(4):
        got = torch.load(check.case_dir(out, family, plan) / f"grads{rank}.pt")
        if set(got) != set(ref):
            lines.append(f"{family} {plan} rank {rank}: names differ: {sorted(set(got) ^ set(ref))}")
            continue
        lines += [f"{family} {plan} rank {rank} {name}: {e:.3g}"
                  for name, e in sorted(relative_errors(got, ref).items()) if e > GRAD_TOLERANCE]
    return lines


@pytest.mark.slow
def test_every_gradient_of_every_family_and_plan_matches_one_process(tmp_path):
    """One torchrun launch runs every (family, plan) case (start-up paid once, one test so that xdist
    cannot launch it twice); every rank's gradient of every parameter is compared."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(SCRIPT), str(tmp_path)]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    print(f"\nhf_grads_check launch ({len(check.cases())} cases): {seconds:.1f} s")
    bad = [line for family, plan in check.cases() for line in gradient_mismatches(tmp_path, family, plan)]
    assert not bad, (f"max |grad - ref| / max |ref| above {GRAD_TOLERANCE:g} for {len(bad)} "
                     "(case, rank, parameter):\n" + "\n".join(bad))
