"""MoE parallel folding in the executor: expert parallelism over dp_shard x cp x tp (etp = 1 and etp = tp),
with ZeRO-2/3, HSDP, capacity dropping and shared experts, on 4 gloo ranks under torchrun
(tests/dist_scripts/moe_fold_check.py), against the single-process reference run: every parameter's
first-step gradient and the 3 step losses. One process: the folded expert mesh's groups by hand and
the refusals of what does not run."""

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
from executor.moe import MoE
from executor.parallelize import check_supported, expert_mesh_shape
from executor.reference import reference_run
from planner.contracts import ModelSpec, MoESpec, ParallelLayout, TrainingConfig
from planner.errors import AutoparError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist_scripts" / "moe_fold_check.py"
# per parameter: max |dist - ref| <= GRAD_REL x max |ref| (a wrong reduction, a missing TP sum, a
# token routed twice or dropped differently is off by O(1) of the gradient); losses: relative
LOSS_REL = 2e-6
GRAD_REL = 1e-5

sys.path.insert(0, str(SCRIPT.parent))
_spec = importlib.util.spec_from_file_location("moe_fold_check", SCRIPT)
fold = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fold)
pc = fold.parallel_check


# ---------------------------------------------------------------- one process
def fold_groups(layout: ParallelLayout) -> dict[str, list[list[int]]]:
    """The EP, ETP and expert-dp groups of the fold written out from the rank order: rank
    = ((pp x dp_replicate + r) x F + f) for fold index f = (edp x ep + e) x etp + t, F = dp_shard x cp x tp."""
    sizes, _ = expert_mesh_shape(layout)
    pp, rep, edp, ep, etp = sizes
    fsize = edp * ep * etp

    def rank(p, r, d, e, t):
        return (p * rep + r) * fsize + (d * ep + e) * etp + t
    idx = [(p, r, d, e, t) for p in range(pp) for r in range(rep) for d in range(edp) for e in range(ep)
           for t in range(etp)]
    return {"ep": sorted({tuple(rank(p, r, d, x, t) for x in range(ep)) for p, r, d, _, t in idx}),
            "etp": sorted({tuple(rank(p, r, d, e, x) for x in range(etp)) for p, r, d, e, _ in idx}),
            "expert_dp": sorted({tuple(rank(p, y, x, e, t) for y in range(rep) for x in range(edp))
                                 for p, _, _, e, t in idx})}


def test_expert_mesh_folds_with_etp_innermost() -> None:
    """dp_shard=2 x tp=2, ep=2 etp=1: EP over the TP pair; etp=2: the ETP group is the TP pair and
    EP crosses the data shards; cp=2 x tp=2 with ep=4: one EP group of all four ranks."""
    assert expert_mesh_shape(ParallelLayout(dp_shard=2, tp=2, sp=True, ep=2, etp=1)) == (
        (1, 1, 2, 2, 1), ("pp", "dp_replicate", "edp", "ep", "etp"))
    g = fold_groups(ParallelLayout(dp_shard=2, tp=2, sp=True, ep=2, etp=1))
    assert g == {"ep": [(0, 1), (2, 3)], "etp": [(0,), (1,), (2,), (3,)], "expert_dp": [(0, 2), (1, 3)]}
    g = fold_groups(ParallelLayout(dp_shard=2, tp=2, sp=True, ep=2))
    assert g == {"ep": [(0, 2), (1, 3)], "etp": [(0, 1), (2, 3)], "expert_dp": [(0,), (1,), (2,), (3,)]}
    g = fold_groups(ParallelLayout(dp_replicate=2, dp_shard=2, cp=2, ep=2))
    assert g["ep"] == [(0, 1), (2, 3), (4, 5), (6, 7)] and g["expert_dp"] == [(0, 2, 4, 6), (1, 3, 5, 7)]


MOE = ModelSpec(name="t", num_layers=2, hidden_size=32, num_attention_heads=8, num_kv_heads=4,
                ffn_hidden_size=64, vocab_size=128,
                moe=MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=24))


@pytest.mark.parametrize(("layout", "field", "words"), [
    (ParallelLayout(dp_shard=2, tp=2, ep=2, etp=1), "layout.sp=False", "sequence parallelism"),
    (ParallelLayout(tp=4, sp=True, etp=2), "layout.etp=2", "neither 1 nor tp=4"),
    (ParallelLayout(dp_shard=2, tp=2, sp=True, ep=4), "layout.ep=4", "ep=4 x etp=2 must divide"),
    (ParallelLayout(dp_shard=2, cp=2, ep=8), "layout.ep=8", "must divide the dp_shard x cp x tp = 4"),
    (ParallelLayout(tp=2, sp=True, etp=3), "layout.etp=3", "etp=3 must divide tp=2"),
])
def test_what_does_not_fold_is_refused(layout, field, words) -> None:
    with pytest.raises(AutoparError) as info:
        check_supported(layout, MOE)
    assert str(info.value).startswith(field) and words in str(info.value), str(info.value)


def test_expert_ffn_must_split_over_etp_and_hf_moe_takes_tp_with_whole_experts() -> None:
    wide = MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"expert_ffn_hidden_size": 25})})
    with pytest.raises(AutoparError, match=r"layout\.etp=2 does not divide moe\.expert_ffn_hidden_size=25"):
        check_supported(ParallelLayout(dp_shard=2, tp=2, sp=True, ep=2), wide)
    check_supported(ParallelLayout(dp_shard=2, tp=2, sp=True, ep=2, etp=1), wide)
    check_supported(ParallelLayout(dp_shard=2, cp=2, ep=4, zero_stage=3), MOE,
                    TrainingConfig(seq_length=16, global_batch_size=4))
    with pytest.raises(AutoparError, match=r"layout\.etp=2 splits the routed experts' FFN"):
        check_supported(ParallelLayout(tp=2, sp=True), MOE, hf=True)
    check_supported(ParallelLayout(tp=2, sp=True, etp=1), MOE, hf=True)  # experts whole, folded over TP
    check_supported(ParallelLayout(cp=2, dp_shard=2, ep=4), MOE, hf=True)  # CP and EP run HF MoE models


def test_shared_experts_must_split_over_tp() -> None:
    """The shared experts' FFN width must split over the TP ranks (checked before any weight moves)."""
    from executor.moe import GroupedExperts, shard_shared_experts

    class TwoRanks:  # the one call made before the check passes: the mesh's size
        def size(self) -> int:
            return 2

    with pytest.raises(AutoparError, match=r"layout\.tp=2 does not divide the shared experts' FFN width 25"):
        shard_shared_experts(GroupedExperts(1, 32, 25), TwoRanks())


# ---------------------------------------------------------------- torchrun, 4 ranks
@pytest.fixture(scope="module")
def fold_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe_fold")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(SCRIPT), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    print(f"moe_fold_check under torchrun: {time.perf_counter() - start:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def _reference(name: str) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Losses, first-step gradients and the assignments capacity dropped over the run's forwards."""
    kind, fields, _ = fold.CASES[name]
    spec = fold.SPECS[kind]
    model = build_model(spec, device="cpu")
    init_weights(model, pc.SEED)
    dropped = [0]

    def count(moe: MoE, args, _out) -> None:
        keep = moe._keep_mask(moe.route(args[0].reshape(-1, args[0].shape[-1]))[0])
        dropped[0] += 0 if keep is None else int((~keep).sum())

    for m in model.modules():
        if isinstance(m, MoE):
            m.register_forward_hook(count)
    ref = reference_run(model, SyntheticTokens(spec.vocab_size, pc.SEQ, pc.SEED), steps=pc.STEPS,
                        global_batch=pc.global_batch(ParallelLayout(**fields)), micro_batch_size=pc.MBS,
                        lr=pc.LR)
    return ref.losses, ref.grads_first_step, dropped[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(fold.CASES))
def test_folded_moe_matches_the_single_process_reference(fold_run: Path, name: str) -> None:
    ref_losses, ref_grads, dropped = _reference(name)
    if fold.SPECS[fold.CASES[name][0]].moe.capacity_factor is not None:
        assert dropped > 0, f"{name}: capacity drops nothing, the case would not test dropping"
    for rank in range(4):
        got = json.loads((fold_run / name / f"rank{rank}.json").read_text())
        for step, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
            assert abs(a - b) <= LOSS_REL * abs(b), f"{name} rank {rank} step {step}: {a} vs ref {b}"
    grads = torch.load(fold_run / name / "grads.pt")
    assert set(grads) == set(ref_grads), f"{name}: parameter names differ from the reference model's"
    worst = {}
    for pname, ref in ref_grads.items():
        scale = ref.abs().max().item()
        assert scale > 0, f"{name}: reference gradient of {pname} is zero, the comparison would be vacuous"
        worst[pname] = (grads[pname] - ref).abs().max().item() / scale
    top = max(worst, key=worst.get)
    routed = max(v for k, v in worst.items() if ".moe.experts." in k)
    shared = max((v for k, v in worst.items() if ".shared_experts." in k), default=0.0)
    router = max(v for k, v in worst.items() if ".moe.gate." in k)
    print(f"\n{name}: worst per-parameter relative error {worst[top]:.2e} ({top}); routed experts "
          f"{routed:.1e}, shared experts {shared:.1e}, router {router:.1e}")
    bad = {k: v for k, v in worst.items() if v > GRAD_REL}
    assert not bad, f"{name}: gradients off by more than {GRAD_REL} x max|ref|: {bad}"
    assert ref_losses[0] != ref_losses[-1]


@pytest.mark.slow
def test_folded_expert_checkpoint_resumes_under_another_plan(tmp_path: Path) -> None:
    """Expert weights keep their names: a checkpoint of cp2 x tp2 with the experts split over ep x etp
    (2-D DTensors) resumes under ZeRO-3 with ep=4 over dp_shard and continues the reference loss curve."""
    import shutil

    from run_plans import GBS, SEQ, TRAINING, profile_for, torchrun_worker

    from planner.contracts import RunReport
    from planner.tune import plan_for

    spec = fold.SPECS["moe_cap"].model_copy(update={"vocab_size": 64})
    ref = reference_run(spec, SyntheticTokens(spec.vocab_size, SEQ, 0), steps=4, global_batch=GBS,
                        micro_batch_size=1).losses

    def run(name: str, ckpt: Path, *args: str, **fields) -> list[float]:
        lay = ParallelLayout(**fields, micro_batch_size=1)
        (tmp_path / f"{name}.json").write_text(plan_for(spec, TRAINING, lay, profile_for(4)).model_dump_json())
        torchrun_worker(tmp_path / f"{name}.json", 4, "--steps", "4", "--warmup", "0", "--checkpoint-dir",
                        str(ckpt), "--out", str(tmp_path / f"{name}.out.json"), *args)
        report = RunReport.model_validate_json((tmp_path / f"{name}.out.json").read_text())
        return [s.loss for s in report.steps]

    saved = run("fold", tmp_path / "a", "--checkpoint-every", "2", cp=2, tp=2, sp=True, ep=2)
    assert saved == pytest.approx(ref, rel=1e-5)
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step_2", tmp_path / "b" / "step_2")
    resumed = run("fsdp", tmp_path / "b", "--resume", dp_shard=4, ep=4, zero_stage=3)
    assert resumed[:2] == saved[:2] and resumed[2:] == pytest.approx(ref[2:], rel=1e-5)


def _hand_counts(spec: ModelSpec, layout: ParallelLayout) -> dict[str, float]:
    """Parameters one rank holds per part, written out from the shapes: attention, the shared experts
    (a TP-split MLP: 1/tp), the routed experts (1/(ep x etp)), embedding and head (vocabulary over tp);
    ``replicated``: the norms and the router, whole on every TP rank."""
    h, a, k, d, v, n = (spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.head_size,
                        spec.vocab_size, spec.num_layers)
    moe, tp = spec.moe, layout.tp
    mats = 3 if spec.ffn_kind == "swiglu" else 2
    layers = spec.num_moe_layers
    assert layers == n, "every layer is a MoE layer in these cases"
    return {"attention": n * (h * a * d + 2 * h * k * d + a * d * h) / tp,
            "shared": layers * moe.num_shared_experts * mats * h * moe.shared_ffn / tp,
            "routed": layers * moe.num_experts * mats * h * moe.expert_ffn_hidden_size / (layout.ep * layout.expert_tp),
            "vocab": 2 * v * h / tp,
            "replicated": (2 * n + 1) * h + layers * moe.num_experts * h}


def _part(name: str) -> str:
    if ".shared_experts." in name:
        return "shared"
    if ".moe.experts." in name:
        return "routed"
    if ".attention." in name:
        return "attention"
    if name.startswith(("tok_embeddings.", "output.")):
        return "vocab"
    assert name.endswith("norm.weight") or ".moe.gate." in name, name
    return "replicated"


@pytest.mark.slow
@pytest.mark.parametrize("name", fold.PARAM_CASES)
def test_each_ranks_parameters_are_the_cost_models(fold_run: Path, name: str) -> None:
    """The shards the executor gives each rank (local element count x element size, fp32, ZeRO-0)
    against hand counts per part and against the cost model's parameter memory of the rank
    (``predict(...).memory.params_bytes``), which must be equal: the norms and the router whole on
    every TP rank (planner.cost.params.tp_replicated_params), everything else split. Shared experts
    held whole on every TP rank (tp x their memory) fail this test."""
    from run_plans import profile_for

    from planner.cost.predict import predict

    kind, fields, _ = fold.CASES[name]
    spec, layout = fold.SPECS[kind], ParallelLayout(**fields)
    hand = _hand_counts(spec, layout)
    training = TrainingConfig(seq_length=pc.SEQ, global_batch_size=pc.global_batch(layout), precision="fp32")
    predicted = predict(spec, training, profile_for(4), layout).memory.params_bytes
    expected = 4 * sum(hand.values())
    assert predicted == pytest.approx(expected, rel=1e-12), f"{name}: cost model {predicted} B, hand count {expected} B"
    for rank in range(4):
        local = json.loads((fold_run / name / f"params_rank{rank}.json").read_text())
        got = dict.fromkeys(hand, 0)
        for pname, (numel, size) in local.items():
            assert size == 4, f"{name}: {pname} is not fp32"
            got[_part(pname)] += numel
        assert got == hand, f"{name} rank {rank}: per-part parameters {got}, by hand {hand}"
        actual = 4 * sum(got.values())
        print(f"\n{name} rank {rank}: executor {actual} B, cost model {predicted} B")
        assert actual == pytest.approx(predicted, rel=1e-12), name
