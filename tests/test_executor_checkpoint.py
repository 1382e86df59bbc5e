"""DCP checkpoints under torchrun (4 ranks, gloo): resuming under the same plan reproduces the losses
bit for bit; resuming under another plan (PP2xDP2 -> DP4, TP2xDP2 -> FSDP4, 4 ranks -> 2 ranks, ZeRO-1
-> PP2xTP2) continues the single-process fp32 loss curve; async saves load like synchronous ones."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist_scripts"))
from run_plans import reference_losses, torchrun_worker, write_plan

from executor.checkpoint import latest_step
from planner.contracts import Plan, RunReport
from planner.cost.checks import default_layer_split
from planner.cost.goodput import state_tensors_per_rank
from planner.cost.params import embedding_tensors, layer_tensors

STEPS = 4


def _losses(report: Path) -> dict[int, float]:
    return {s.step: s.loss for s in RunReport.model_validate_json(report.read_text()).steps}


def _run(tmp: Path, name: str, nproc: int, ckpt: Path, *args: str, **layout: object) -> dict[int, float]:
    write_plan(tmp / f"{name}.json", **layout)
    torchrun_worker(tmp / f"{name}.json", nproc, "--steps", str(STEPS), "--warmup", "0", "--checkpoint-dir",
                    str(ckpt), "--out", str(tmp / f"{name}.report.json"), *args)
    return _losses(tmp / f"{name}.report.json")


def _from_step2(src: Path, dst: Path) -> Path:
    """A checkpoint directory holding only ``src``'s step 2 (so a resume continues at step 2)."""
    dst.mkdir(parents=True)
    shutil.copytree(src / "step_2", dst / "step_2")
    return dst


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Uninterrupted 4-step runs saving every 2 steps: PP2xDP2 (async saves), TP2xDP2, ZeRO-1."""
    tmp = tmp_path_factory.mktemp("ckpt")
    runs = {
        "pp2dp2": _run(tmp, "pp2dp2", 4, tmp / "pp2dp2", "--checkpoint-every", "2", "--async-checkpoint",
                       pp=2, dp_shard=2),
        "tp2dp2": _run(tmp, "tp2dp2", 4, tmp / "tp2dp2", "--checkpoint-every", "2", tp=2, dp_shard=2),
        "zero1": _run(tmp, "zero1", 4, tmp / "zero1", "--checkpoint-every", "2", dp_shard=4, zero_stage=1),
    }
    return {"tmp": tmp, "losses": runs, "reference": reference_losses(STEPS)[0]}


@pytest.mark.slow
def test_uninterrupted_runs_match_the_reference_and_save_every_k_steps(saved: dict) -> None:
    for name, losses in saved["losses"].items():
        assert list(losses) == list(range(STEPS))
        assert list(losses.values()) == pytest.approx(saved["reference"], rel=1e-5), name
        assert latest_step(saved["tmp"] / name) == STEPS
        assert sorted(p.name for p in (saved["tmp"] / name).iterdir()) == ["step_2", "step_4"]


@pytest.mark.slow
def test_the_report_records_each_checkpoint_s_blocking_and_write_times(saved: dict) -> None:
    """Rank 0's checkpoints, sync and async: what planner.cost.goodput predicts (benchmarks/goodput.py)."""
    for name, mode in (("pp2dp2", "async"), ("tp2dp2", "sync")):
        report = RunReport.model_validate_json((saved["tmp"] / f"{name}.report.json").read_text())
        assert [c.step for c in report.checkpoints] == [2, 4] and {c.mode for c in report.checkpoints} == {mode}
        plan = Plan.model_validate_json((saved["tmp"] / f"{name}.json").read_text())
        # the planner's count of the parameter tensors rank 0 saves (the checkpoint's per-tensor cost)
        first_stage = embedding_tensors(plan.model) + sum(layer_tensors(plan.model, i) for i in range(
            default_layer_split(plan.model.num_layers, plan.layout.pp)[0]))
        want = state_tensors_per_rank(plan.model, plan.layout) if plan.layout.pp == 1 else first_stage
        for c in report.checkpoints:
            assert c.bytes_per_rank > 0 and 0 < c.blocking_s <= c.write_s < 60
            assert c.tensors_per_rank == want, (name, c.tensors_per_rank, want)
            if mode == "sync":
                assert c.write_s == pytest.approx(c.blocking_s, rel=0.05, abs=1e-3)


@pytest.mark.slow
def test_same_plan_resume_reproduces_the_losses_exactly(saved: dict) -> None:
    tmp = saved["tmp"]
    ckpt = _from_step2(tmp / "pp2dp2", tmp / "same")
    resumed = _run(tmp, "pp2dp2_again", 4, ckpt, "--resume", pp=2, dp_shard=2)
    assert resumed == saved["losses"]["pp2dp2"]  # steps 0-1 from the checkpoint, 2-3 recomputed: bit-identical


@pytest.mark.slow
@pytest.mark.parametrize(("source", "target", "nproc", "layout"), [
    ("pp2dp2", "dp4", 4, {"dp_shard": 4}),
    ("tp2dp2", "fsdp4", 4, {"dp_shard": 4, "zero_stage": 3}),
    ("pp2dp2", "dp2", 2, {"dp_shard": 2}),
    ("zero1", "pp2tp2", 4, {"pp": 2, "tp": 2}),
])
def test_resume_under_another_plan_continues_the_loss_curve(saved: dict, source: str, target: str, nproc: int,
                                                           layout: dict) -> None:
    tmp = saved["tmp"]
    ckpt = _from_step2(tmp / source, tmp / f"{source}_to_{target}")
    resumed = _run(tmp, f"{source}_to_{target}", nproc, ckpt, "--resume", **layout)
    ref = saved["reference"]
    assert [resumed[s] for s in (2, 3)] == pytest.approx(ref[2:], rel=1e-5)
    # the restored history is the source run's
    assert [resumed[s] for s in (0, 1)] == [saved["losses"][source][s] for s in (0, 1)]


@pytest.mark.parametrize("hf", [False, True])
def test_a_rank_s_chunks_save_under_the_model_s_names(hf: bool) -> None:
    """Interleaved and V schedules give a rank several chunks; the checkpoint sees them as one module with the
    unsplit model's names (a Hugging Face chunk's stand-in norm and head hold nothing)."""
    from executor.checkpoint import _module
    from executor.pipeline import split_model
    from planner.contracts import ParallelLayout

    if hf:
        from executor.hf import build_hf_model

        model = build_hf_model({"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
                                "tie_word_embeddings": False})
    else:
        from run_plans import SPEC

        from executor.model import build_model

        model = build_model(SPEC)
    layout = ParallelLayout(pp=2, schedule="zero_bubble_v", virtual_stages=2)
    parts = split_model(model, layout, 0)  # chunks 0 and 3: the embedding, the first and the last layers, the head
    merged = set(_module(parts).state_dict())
    assert merged == {k for part in parts for k, v in part.state_dict().items()}
    assert merged < set(model.state_dict()) and any("embed" in k for k in merged)
    assert any(k.endswith("norm.weight") and "layers" not in k for k in merged)


@pytest.mark.parametrize("preset", ["llama3-8b", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_the_planner_counts_the_parameter_tensors_the_executor_builds(preset: str) -> None:
    """``planner.cost.params.layer_tensors`` and friends against the built-in model's parameters (small widths, the
    preset's structure; the built-in model has no per-head q/k norms, which the count prices for HF models)."""
    from executor.model import build_model
    from planner.contracts import ParallelLayout
    from planner.presets import get_preset

    m = get_preset(preset)
    small = m.model_copy(update={"num_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
                                 "ffn_hidden_size": 96, "vocab_size": 128, "head_dim": None, "qk_norm": False})
    if m.moe is not None:
        small = small.model_copy(update={"moe": m.moe.model_copy(update={"num_experts": 4, "top_k": 2,
                                                                          "expert_ffn_hidden_size": 32})})
    small = type(m).model_validate(small.model_dump())
    built = build_model(small, device="meta")
    assert len(list(built.parameters())) == state_tensors_per_rank(small, ParallelLayout())
