"""executor.parallelize: mesh shapes, refusals and recompute placement in one process; every
non-pipeline layout under torchrun (4 gloo ranks, tests/dist_scripts/parallel_check.py) against the
single-process reference run: the 3 step losses and the first step's gradients within 1e-5."""

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

from executor.data import SyntheticTokens
from executor.model import build_model, init_weights
from executor.parallelize import (
    _block_plan,
    _unsharded_styles,
    apply_recompute,
    build_mesh,
    check_supported,
    clean_fqn,
    expert_mesh_shape,
    grad_scale,
    mesh_shape,
)
from executor.reference import reference_run
from planner.contracts import ModelSpec, MoESpec, ParallelLayout, StageRecompute, TrainingConfig
from planner.errors import AutoparError

SCRIPT = Path(__file__).parent / "dist_scripts" / "parallel_check.py"
TOLERANCE = 1e-5  # fp32: |dist - ref| <= TOLERANCE * (1 + |ref|) for losses and every gradient element

_spec = importlib.util.spec_from_file_location("parallel_check", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

DENSE = ModelSpec(name="t", num_layers=2, hidden_size=32, num_attention_heads=8, num_kv_heads=4,
                  ffn_hidden_size=64, vocab_size=128)
MOE = DENSE.model_copy(update={"moe": MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=16)})


# ---------------------------------------------------------------- one process
def test_mesh_shape_keeps_every_dim_and_folds_ep_on_a_second_mesh() -> None:
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert mesh_shape(ParallelLayout(dp_shard=4, tp=2)) == ((1, 1, 4, 1, 2), names)
    assert mesh_shape(ParallelLayout(dp_replicate=2, dp_shard=4, ep=2)) == ((1, 2, 4, 1, 1), names)
    assert expert_mesh_shape(ParallelLayout(dp_replicate=2, dp_shard=4, ep=2)) == (
        (1, 2, 2, 2, 1), ("pp", "dp_replicate", "edp", "ep", "etp"))


def test_grad_scale_counts_the_ranks_the_reduction_averages_over() -> None:
    assert grad_scale(ParallelLayout(dp_replicate=2, dp_shard=3, cp=2, tp=4, pp=2)) == 12


def test_build_mesh_names_every_degree_when_the_product_is_wrong() -> None:
    with pytest.raises(AutoparError) as info:
        build_mesh(ParallelLayout(dp_shard=2, tp=4), 4, "cpu")
    msg = str(info.value)
    assert "dp_shard=2" in msg and "tp=4" in msg and "= 8" in msg
    assert "4 processes" in msg and "launch 8" in msg


@pytest.mark.parametrize(("layout", "spec", "field", "words"), [
    (ParallelLayout(tp=4), DENSE.model_copy(update={"num_kv_heads": 2}), "layout.tp=4", "num_kv_heads=2"),
    (ParallelLayout(tp=3), DENSE, "layout.tp=3", "num_attention_heads=8"),
    (ParallelLayout(tp=2), DENSE.model_copy(update={"tied_embeddings": True}), "layout.tp=2", "tied"),
    (ParallelLayout(tp=2), MOE, "layout.sp=False", "sequence parallelism"),
    (ParallelLayout(dp_shard=4, ep=2), DENSE, "layout.ep=2", "Mixture-of-Experts"),
    (ParallelLayout(dp_shard=2, ep=4), MOE, "layout.ep=4", "dp_shard x cp x tp = 2"),
    (ParallelLayout(dp_shard=3, ep=3), MOE, "layout.ep=3", "experts evenly"),
    (ParallelLayout(dp_shard=2, tp=2, zero_stage=1), DENSE, "layout.zero_stage=1", "ZeroRedundancyOptimizer"),
    (ParallelLayout(dp_shard=4, offload_optimizer=True), DENSE, "layout.offload_optimizer=True", "FSDP2"),
])
def test_check_supported_refuses_with_the_reason(layout, spec, field, words) -> None:
    with pytest.raises(AutoparError) as info:
        check_supported(layout, spec)
    assert str(info.value).startswith(field) and words in str(info.value)


def test_check_supported_sequence_length_and_hf_limits() -> None:
    training = TrainingConfig(seq_length=20, global_batch_size=4)
    with pytest.raises(AutoparError, match=r"training\.seq_length=20 .*multiple of 8"):
        check_supported(ParallelLayout(cp=2, tp=2, sp=True), DENSE, training)
    check_supported(ParallelLayout(dp_shard=2, recompute="selective"), DENSE, hf=True)  # HF: the core recomputed
    check_supported(ParallelLayout(cp=2), DENSE, hf=True)  # context parallelism runs HF models too
    check_supported(ParallelLayout(dp_replicate=2, dp_shard=2, cp=2, tp=2, sp=True, zero_stage=3), DENSE,
                    TrainingConfig(seq_length=16, global_batch_size=4))
    check_supported(ParallelLayout(dp_shard=4, ep=2, zero_stage=2), build_model(MOE))


def test_check_supported_reads_a_hugging_face_model() -> None:
    """A module that is not the built-in decoder is checked from its config and as an HF model."""
    from executor.hf import build_hf_model

    with torch.device("meta"):
        model = build_hf_model(check.HF_CONFIG)
    check_supported(ParallelLayout(dp_shard=2, tp=4, sp=True, zero_stage=3), model)
    with pytest.raises(AutoparError, match=r"layout\.tp=8 .*num_kv_heads=4"):
        check_supported(ParallelLayout(tp=8), model)
    check_supported(ParallelLayout(recompute="selective"), model)


def test_every_unsharded_weight_gets_a_tp_style_by_where_it_sits() -> None:
    """Inside attention/MLP (Qwen3's q/k norms): this rank's share, gradient summed over TP; on the
    residual stream: SequenceParallel with SP, nothing without (every TP rank holds the whole gradient)."""
    from executor.adapters import HF
    from executor.hf import build_hf_model

    with torch.device("meta"):
        model = build_hf_model({**check.HF_CONFIG, "model_type": "qwen3", "head_dim": 4})
    layer, share = model.model.layers[0], "SequenceParallel(sequence_dim=0, use_local_output=True)"
    for sp in (False, True):
        plan = _block_plan(ParallelLayout(tp=2, sp=sp), HF, hf=True)
        styles = {p: repr(s) for p, s in _unsharded_styles(layer, plan, ("self_attn", "mlp"), sp).items()}
        stream = {n: "SequenceParallel(sequence_dim=1, use_local_output=False)"
                  for n in ("input_layernorm", "post_attention_layernorm")} if sp else {}
        assert styles == {"self_attn.q_norm": share, "self_attn.k_norm": share, **stream}
        planned = {"model.embed_tokens": 0, "lm_head": 0}
        top = _unsharded_styles(model, planned, (), sp, skip=("model.layers.",))
        assert list(top) == (["model.norm"] if sp else [])


def test_recompute_wraps_the_first_n_blocks_of_the_stage() -> None:
    spec = DENSE.model_copy(update={"num_layers": 3})
    model = build_model(spec)
    apply_recompute(model, StageRecompute(kind="full", num_layers=2), ParallelLayout())
    wrapped = [type(b).__name__ == "CheckpointWrapper" for b in model.layers.values()]
    assert wrapped == [True, True, False]
    model = build_model(spec)
    apply_recompute(model, None, ParallelLayout(recompute="selective"))
    assert all(b.attention.recompute_core for b in model.layers.values())
    assert not any(type(b).__name__ == "CheckpointWrapper" for b in model.layers.values())


def test_selective_and_full_recompute_keep_loss_and_gradients() -> None:
    """One process: recompute changes what is stored, never the numbers."""
    data = SyntheticTokens(DENSE.vocab_size, 16, 0).batch(0, 2)
    grads = []
    for layout, stage in [(ParallelLayout(), None), (ParallelLayout(recompute="selective"), None),
                          (ParallelLayout(), StageRecompute(kind="full", num_layers=1))]:
        model = build_model(DENSE, device="cpu")
        init_weights(model, 0)
        apply_recompute(model, stage, layout)
        loss = torch.nn.functional.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
        loss.backward()
        grads.append({clean_fqn(n): p.grad for n, p in model.named_parameters()})
    for other in grads[1:]:
        assert all(torch.allclose(grads[0][n], other[n], atol=1e-6) for n in grads[0])


def _backward_matmuls(model: torch.nn.Module, data: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    """aten.mm calls of one backward (recomputed forward matmuls included) and the gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            Count.calls += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    loss = torch.nn.functional.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
    with Count():
        loss.backward()
    return Count.calls, {clean_fqn(n): p.grad for n, p in model.named_parameters()}


def test_per_op_recompute_runs_again_every_second_matmul_and_keeps_the_gradients() -> None:
    """Per-op SAC (executor.sac) re-runs wk, wo and w3 of each block (its 2nd, 4th and 6th matmul: 3 more
    matmuls a block than no recompute; full recompute re-runs 6: torch's checkpoint stops once the last
    tensor the backward needs is rebuilt, so w2 never runs again) and changes no gradient."""
    data = SyntheticTokens(DENSE.vocab_size, 16, 0).batch(0, 2)
    runs = {}
    for kind in ("none", "op", "full"):
        model = build_model(DENSE, device="cpu")
        init_weights(model, 0)
        apply_recompute(model, None, ParallelLayout(recompute=kind))
        runs[kind] = _backward_matmuls(model, data)
    (none, g_none), (op, g_op), (full, g_full) = runs["none"], runs["op"], runs["full"]
    assert (op - none, full - none) == (3 * DENSE.num_layers, 6 * DENSE.num_layers)
    for grads in (g_op, g_full):
        assert all(torch.allclose(g_none[n], grads[n], atol=1e-6) for n in g_none)


def test_per_op_recompute_keeps_biased_qkv_and_counts_from_the_output_projection() -> None:
    """Qwen2's biased Q, K, V are addmm: kept and uncounted (planner.cost.sac), so wo and w3 are kept and only w1
    runs again (w2 lies after the last tensor the backward needs); the gradients are unchanged."""
    from planner.cost.sac import kept_linears

    spec = DENSE.model_copy(update={"qkv_bias": True})
    assert [lin.name for lin in kept_linears(spec, 0, 1)] == ["q", "k", "v", "o", "w3"]
    data = SyntheticTokens(spec.vocab_size, 16, 0).batch(0, 2)
    runs = {}
    for kind in ("none", "op"):
        model = build_model(spec, device="cpu")
        init_weights(model, 0)
        assert model.layers["0"].attention.wk.bias is not None and model.layers["0"].attention.wo.bias is None
        apply_recompute(model, None, ParallelLayout(recompute=kind))
        runs[kind] = _backward_matmuls(model, data)
    (none, g_none), (op, g_op) = runs["none"], runs["op"]
    assert op - none == spec.num_layers
    assert all(torch.allclose(g_none[n], g_op[n], atol=1e-6) for n in g_none)


def test_per_op_recompute_keeps_in_an_moe_block_what_the_planner_prices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The matmuls per-op SAC keeps in an MoE block on the CPU are the planner's counted kept linears
    (planner.cost.sac.kept_linears: q and v here): the router and the routed experts' one-GEMM-per-expert
    loop run again, uncounted, as the grouped GEMM they stand for; the gradients are unchanged."""
    from torch.utils.checkpoint import CheckpointPolicy

    import executor.sac as sac
    from planner.cost.sac import kept_linears

    saved: list[bool] = []
    real = sac._policy

    def recording(force):  # noqa: ANN001, ANN202
        policy = real(force)

        def wrapped(ctx, func, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            out = policy(ctx, func, *args, **kwargs)
            if func is torch.ops.aten.mm.default and not ctx.is_recompute:
                saved.append(out == CheckpointPolicy.MUST_SAVE)
            return out
        return wrapped

    monkeypatch.setattr(sac, "_policy", recording)
    data = SyntheticTokens(MOE.vocab_size, 16, 0).batch(0, 2)
    grads = []
    for kind in ("none", "op"):
        model = build_model(MOE, device="cpu")
        init_weights(model, 0)
        apply_recompute(model, None, ParallelLayout(recompute=kind))
        grads.append(_backward_matmuls(model, data)[1])
    per_block = [[lin.name for lin in kept_linears(MOE, i, 1) if lin.counted] for i in range(MOE.num_layers)]
    assert per_block == [["q", "v"]] * MOE.num_layers
    routed = MOE.num_layers * MOE.moe.num_experts * 3  # w1, w3, w2 per expert
    assert (sum(saved), len(saved)) == (2 * MOE.num_layers, (4 + 1) * MOE.num_layers + routed)
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])


def test_per_op_recompute_runs_the_router_again_uncounted() -> None:
    """An MoE block: the router's matmul is always run again and not counted (executor.sac.router_shapes)."""
    from executor.sac import router_shapes

    model = build_model(MOE, device="cpu")
    block = next(iter(model.layers.values()))
    assert router_shapes(block) == {(MOE.hidden_size, MOE.moe.num_experts)}
    assert router_shapes(build_model(DENSE, device="cpu").layers["0"]) == frozenset()


# ---------------------------------------------------------------- torchrun, 4 ranks
@pytest.fixture(scope="module")
def dist_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """All cases of parallel_check.py in one torchrun launch (process start-up paid once)."""
    out = tmp_path_factory.mktemp("parallel")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(SCRIPT), str(out)]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, seconds


def _reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    kind, fields, _ = check.CASES[name]
    model, _ = check.build(kind, "cpu")  # HF: seeded weights; built-in: initialised below
    if kind != "hf":
        init_weights(model, check.SEED)
    vocab = model.config.vocab_size if kind == "hf" else model.spec.vocab_size
    ref = reference_run(model, SyntheticTokens(vocab, check.SEQ, check.SEED), steps=check.STEPS,
                        global_batch=check.global_batch(ParallelLayout(**fields)), micro_batch_size=check.MBS,
                        lr=check.LR)
    return ref.losses, ref.grads_first_step


@pytest.mark.slow
@pytest.mark.parametrize("name", list(check.CASES))
def test_layout_matches_the_single_process_reference(dist_results: tuple[Path, float], name: str) -> None:
    out, _ = dist_results
    ref_losses, ref_grads = _reference(name)
    for rank in range(4):
        got = json.loads((out / name / f"rank{rank}.json").read_text())
        assert len(got["losses"]) == check.STEPS
        for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
            assert abs(a - b) <= TOLERANCE * (1 + abs(b)), f"{name} rank {rank} step {step}: {a} vs ref {b}"
    grads = torch.load(out / name / "grads.pt")
    assert set(grads) == set(ref_grads), f"{name}: parameter names differ from the reference model's"
    for pname, ref in ref_grads.items():
        err = ((grads[pname] - ref).abs() - TOLERANCE * (1 + ref.abs())).max().item()
        assert err <= 0, f"{name}: gradient of {pname} off by {err + TOLERANCE:.2e} beyond the tolerance"
    # the run must move the weights: later losses differ from the first
    assert ref_losses[0] != ref_losses[-1]


@pytest.mark.slow
def test_a_layout_of_a_shape_already_built_creates_no_process_group(dist_results: tuple[Path, float]) -> None:
    """zero1, zero2, zero3 on 4 ranks share one mesh shape (dp_shard 4): the second and third reuse the
    first's groups (executor.parallelize.world_mesh); each gloo group holds threads and sockets until
    the process ends, so a worker applying dozens of plans had hundreds."""
    out, _ = dist_results
    groups = [json.loads((out / n / "rank0.json").read_text())["process_groups"]
              for n in ("zero1_dp4", "zero2_dp4", "zero3_fsdp4")]
    assert groups[0] == groups[1] == groups[2], groups
    assert json.loads((out / "ddp4" / "rank0.json").read_text())["process_groups"] < groups[0]


@pytest.mark.slow
def test_launch_time_is_reported(dist_results: tuple[Path, float]) -> None:
    out, seconds = dist_results
    per_case = {n: json.loads((out / n / "rank0.json").read_text())["seconds"] for n in check.CASES}
    print(f"\nparallel_check launch: {seconds:.1f} s; per case: "
          + ", ".join(f"{n} {s:.1f} s" for n, s in per_case.items()))
    assert seconds < 300
