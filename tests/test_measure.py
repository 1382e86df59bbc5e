"""The step's breakdown by term: the classifier over a profiled operator tree (by hand), the prediction's
terms (they add up to its step), and a real 4-rank run whose report carries each rank's breakdown."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from executor.measure import Node, StepProfiler, device_trees, split_device, split_step
from planner.contracts import ParallelLayout, RunReport, TermTimes, TrainingConfig
from planner.contracts.report import STEP_TERMS, term_comparison
from planner.cost.predict import predict
from planner.presets import get_preset
from planner.reference import reference_profile

sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))


def n(name: str, own: float, *children: Node) -> Node:
    return Node(name, own, list(children))


def test_each_operator_goes_to_one_term_and_the_terms_sum_to_the_step() -> None:
    step = n("autopar.step", 10.0,
             n("aten::linear", 1.0, n("aten::mm", 100.0)),  # a GEMM: the composite's own time is elementwise
             n("aten::_scaled_dot_product_flash_attention_for_cpu", 50.0, n("aten::empty", 2.0)),
             n("aten::cross_entropy_loss", 1.0, n("aten::_log_softmax", 20.0)),
             n("aten::add", 5.0),
             n("FSDP::all_gather", 3.0, n("c10d::_allgather_base_", 40.0), n("aten::copy_", 7.0)),
             n("FSDP::post_backward_reduce", 1.0, n("c10d::_reduce_scatter_base_", 30.0)),
             n("_c10d_functional::all_gather_into_tensor", 15.0),  # unlabelled: TP (tp > 1)
             n("c10d::send", 4.0), n("c10d::recv_", 60.0),  # the pipeline, its wait included
             n("autopar.ep", 0.5, n("c10d::alltoall_base_", 8.0)),
             n("autograd::engine::evaluate_function: MmBackward0", 2.0, n("aten::mm", 200.0)),
             n("autopar.optimizer", 1.0, n("aten::_foreach_add_", 12.0)),
             n("autopar.other", 0.0, n("c10d::allreduce_", 6.0)))
    wall, terms, data = split_step([step, step], tp=2, data=[n("autopar.data", 3.0)])
    us = 1e-6
    assert wall == pytest.approx(sum(terms.values())) and set(terms) == set(STEP_TERMS)
    assert terms["gemm"] == pytest.approx(300 * us)
    assert terms["attention"] == pytest.approx(52 * us)  # the attention op and what it calls
    assert terms["loss"] == pytest.approx(21 * us)
    assert terms["elementwise"] == pytest.approx((1 + 5) * us)  # linear's own time and the add
    assert terms["dp_param"] == pytest.approx(50 * us) and terms["dp_grad"] == pytest.approx(31 * us)
    assert terms["tp"] == pytest.approx(15 * us) and terms["pp"] == pytest.approx(64 * us)
    assert terms["ep"] == pytest.approx(8.5 * us) and terms["optimizer"] == pytest.approx(13 * us)
    assert terms["other"] == pytest.approx((10 + 2 + 6) * us)
    assert data == pytest.approx(1.5 * us)  # per step


def test_an_unlabelled_collective_without_tp_is_data_parallel() -> None:
    """DDP's bucketed all-reduce runs from autograd hooks, outside any label: with tp = 1 it can only be
    the gradients'."""
    _, terms, _ = split_step([n("autopar.step", 0.0, n("c10d::allreduce_", 9.0))], tp=1)
    assert terms["dp_grad"] == pytest.approx(9e-6) and terms["tp"] == 0


@pytest.mark.parametrize("layout", [
    {"tp": 8, "dp_shard": 8, "zero_stage": 3, "micro_batch_size": 1},
    {"tp": 4, "pp": 4, "dp_shard": 4, "zero_stage": 1, "micro_batch_size": 1, "recompute": "selective"},
    {"tp": 8, "pp": 2, "dp_shard": 4, "zero_stage": 1, "micro_batch_size": 2, "recompute": "full"},
])
def test_the_predicted_terms_add_up_to_the_critical_rank_s_step(layout: dict) -> None:
    model, prof = get_preset("llama3.1-70b"), reference_profile("dgx-h100", 8)
    training = TrainingConfig(seq_length=4096, global_batch_size=256)
    p = predict(model, training, prof, ParallelLayout(**layout))
    terms = p.terms
    assert set(terms) == set(STEP_TERMS) and min(terms.values()) >= 0
    # compute by class is the critical rank's busy time less its exposed layer collectives and sends
    compute = sum(terms[t] for t in ("gemm", "attention", "elementwise", "loss", "other"))
    layer_comm = sum(c.exposed_s for c in p.comm if c.kind not in ("dp_grad", "dp_param", "offload"))
    assert compute + layer_comm <= p.compute_time_s * (1 + 1e-9)
    assert terms["optimizer"] == pytest.approx(p.optimizer_time_s)
    assert terms["pp"] >= p.bubble_time_s
    assert sum(terms.values()) == pytest.approx(p.step_time_s, rel=0.02)  # the slowest tail may be another rank's
    if layout.get("pp", 1) == 1:
        assert sum(terms.values()) == pytest.approx(p.step_time_s, rel=1e-9)


def test_term_comparison_reads_shares_of_each_side() -> None:
    report = RunReport.model_validate({
        "layout": {}, "device": "cpu", "num_ranks": 2, "warmup_steps": 0,
        "steps": [{"step": 0, "loss": 1.0, "time_s": 1.0}], "median_step_time_s": 1.0, "tokens_per_s": 1.0,
        "peak_memory_bytes_per_rank": [1, 1],
        "breakdown": [{"rank": 0, "step_s": 2.0, "terms": {"gemm": 1.0, "tp": 1.0}},
                      {"rank": 1, "step_s": 4.0, "terms": {"gemm": 1.0, "tp": 3.0}}]})
    rows = {r["term"]: r for r in term_comparison({"gemm": 3.0, "tp": 1.0}, report)}
    assert set(rows) == {"gemm", "tp"}
    assert rows["gemm"]["measured"] == 1.0 and rows["gemm"]["measured_share"] == pytest.approx(1 / 3)
    assert rows["tp"]["predicted_share"] == pytest.approx(0.25) and rows["tp"]["measured"] == 2.0


def test_a_breakdown_with_an_unknown_term_or_a_negative_time_is_refused() -> None:
    from pydantic import ValidationError

    from planner.contracts import TermTimes

    with pytest.raises(ValidationError, match="unknown terms \\['matmul'\\]"):
        TermTimes(rank=0, step_s=1.0, terms={"matmul": 1.0})
    with pytest.raises(ValidationError, match="seconds >= 0"):
        TermTimes(rank=0, step_s=1.0, terms={"gemm": -1.0})


@pytest.mark.slow
@pytest.mark.parametrize(("name", "moe", "layout", "present"), [
    ("tp2_sp_fsdp2", False, {"tp": 2, "sp": True, "dp_shard": 2, "zero_stage": 3}, ("tp", "dp_param", "dp_grad")),
    ("moe_pp2_cp2_ep2", True, {"pp": 2, "cp": 2, "ep": 2, "schedule": "1f1b", "zero_stage": 3},
     ("pp", "cp", "ep", "dp_param")),
])
def test_a_run_reports_each_rank_s_step_by_term(tmp_path: Path, name: str, moe: bool, layout: dict,
                                                present: tuple[str, ...]) -> None:
    """Under torchrun with gloo: the last 2 of 5 steps are profiled and left out of the median; every rank's
    breakdown sums to its profiled step, its GEMMs and attention are seen, and each dimension the layout has
    shows its collectives under its own name."""
    from run_plans import SPEC, TRAINING, profile_for, torchrun_worker

    from planner.contracts import MoESpec
    from planner.tune import plan_for

    spec = SPEC.model_copy(update={"moe": MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=32)} if moe else {})
    lay = ParallelLayout(**layout, micro_batch_size=1)
    plan = plan_for(spec, TRAINING, lay, profile_for(lay.num_gpus))
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    torchrun_worker(tmp_path / "plan.json", lay.num_gpus, "--steps", "5", "--warmup", "1", "--profile-steps", "2",
                    "--out", str(tmp_path / "r.json"))
    report = RunReport.model_validate_json((tmp_path / "r.json").read_text())
    assert [s.profiled for s in report.steps] == [False, False, False, True, True], name
    assert report.median_step_time_s == pytest.approx(sorted(s.time_s for s in report.steps[1:3])[0]
                                                      + 0.5 * abs(report.steps[1].time_s - report.steps[2].time_s))
    assert sorted(t.rank for t in report.breakdown) == list(range(lay.num_gpus)), name
    for t in report.breakdown:
        assert sum(t.terms.values()) == pytest.approx(t.step_s, rel=1e-6), (name, t)
        assert t.terms["gemm"] > 0 and t.terms["attention"] > 0 and t.terms["elementwise"] > 0, (name, t)
        assert t.terms["optimizer"] > 0 and t.data_s > 0, (name, t)
        for kind in set(("tp", "cp", "ep", "pp")) - set(present):
            assert t.terms[kind] == 0, (name, kind, t)
    for kind in present:  # every rank of the dimension takes part; at least one shows it
        assert max(t.terms[kind] for t in report.breakdown) > 0, (name, kind)
    assert any(t.terms["loss"] > 0 for t in report.breakdown), name  # the last pipeline stage's


def test_collectives_under_compute_are_communication_and_pipeline_waits_are_the_pipeline_s() -> None:
    """Found by review: loss-parallel's all-reduce runs under the log-softmax, ZeRO-1's broadcast under the
    optimizer step, and torch's schedules wait for their neighbour in their own step labels."""
    step = n("autopar.step", 0.0,
             n("aten::_log_softmax", 5.0, n("_c10d_functional::all_reduce", 7.0),
               n("_c10d_functional::wait_tensor", 3.0)),
             n("autopar.optimizer", 1.0, n("aten::_foreach_mul_", 4.0), n("c10d::broadcast_", 6.0)),
             n("Forward 2", 30.0, n("aten::mm", 2.0)), n("PP:1RECV_F3", 20.0),
             n("FSDP::all_gather", 0.0, n("c10d::_allgather_base_", 9.0)),
             n("autopar.other", 0.0, n("c10d::allreduce_", 1.0)))
    _, terms, _ = split_step([step], tp=2)
    us = 1e-6
    assert terms["loss"] == pytest.approx(5 * us) and terms["tp"] == pytest.approx(10 * us)
    assert terms["optimizer"] == pytest.approx(5 * us) and terms["dp_param"] == pytest.approx((6 + 9) * us)
    assert terms["pp"] == pytest.approx(50 * us) and terms["gemm"] == pytest.approx(2 * us)
    assert terms["other"] == pytest.approx(1 * us)


def ev(name: str, start: float, end: float, *children: SimpleNamespace, dev: float = 0.0, cpu: float = 0.0,
       thread: int = 1, on: DeviceType = DeviceType.CPU) -> SimpleNamespace:
    """A FunctionEvent as torch.profiler gives it (times in microseconds), its children's parent set."""
    e = SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), cpu_parent=None,
                        cpu_children=list(children), self_device_time_total=dev, self_cpu_time_total=cpu,
                        thread=thread, device_type=on, is_async=False)
    for c in children:
        c.cpu_parent = e
    return e


def flat(*roots: SimpleNamespace) -> list[SimpleNamespace]:
    return [e for r in roots for e in (r, *flat(*r.cpu_children))]


def cuda_step(t: float, wall: float) -> list[SimpleNamespace]:
    """One CUDA step at ``t`` with its batch made before it: the forward on the main thread, the backward on the
    autograd engine's, the kernels' own events and the step label's copy on the device timeline."""
    main = ev("autopar.step", t, t + wall,
              ev("FSDP::all_gather", t + 1, t + 9, ev("nccl:_all_gather_base", t + 2, t + 8, dev=50)),
              ev("aten::linear", t + 10, t + 100, ev("aten::mm", t + 20, t + 90, dev=150), dev=2),
              ev("aten::scaled_dot_product_attention", t + 100, t + 200,
                 ev("aten::_scaled_dot_product_flash_attention", t + 110, t + 190, dev=80)),
              ev("aten::cross_entropy_loss", t + 200, t + 250, ev("aten::_log_softmax", t + 205, t + 220, dev=20),
                 ev("aten::nll_loss_forward", t + 225, t + 245, dev=5)),
              ev("autopar.optimizer", t + 600, t + 700, ev("aten::_foreach_mul_", t + 610, t + 640, dev=30),
                 ev("aten::_foreach_add_", t + 650, t + 690, dev=40)))
    backward = ev("autograd::engine::evaluate_function: MmBackward0", t + 300, t + 400,
                  ev("MmBackward0", t + 305, t + 395, ev("aten::mm", t + 310, t + 350, dev=140),
                     ev("aten::mm", t + 355, t + 390, dev=160)), thread=2)
    grad = ev("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", t + 400, t + 450,
              ev("aten::add_", t + 405, t + 445, dev=10), thread=2)
    data = ev("autopar.data", t - 80, t - 10, ev("aten::to", t - 70, t - 20, cpu=10, dev=25), cpu=40)
    device = [ev("sm90_xmma_gemm_f32f32", t + 30, t + 180, dev=150, on=DeviceType.CUDA),  # kernels: not roots
              ev("autopar.step", t, t + wall + 50, dev=wall + 50, on=DeviceType.CUDA)]  # the label's device copy
    return [*flat(data, main, backward, grad), *device]


def test_a_cuda_step_is_split_by_device_time_with_the_idle_device_in_other() -> None:
    """Two steps (1000 and 1200 us): each operator's own kernels' time goes to its term, the backward on the
    autograd thread included (its engine root is no label), and what is left of the wall is the device idle."""
    late = ev("autograd::engine::evaluate_function: MmBackward0", 1500, 1600, ev("aten::mm", 1510, 1590, dev=999),
              thread=2)  # between the steps: not profiled
    events = [*cuda_step(100, 1000), *flat(late), *cuda_step(2000, 1200)]
    walls, roots, data = device_trees(events)
    assert walls == [1000, 1200] and len(data) == 2
    assert sorted(r.name for r in roots).count("autopar.step") == 2 and len(roots) == 6
    wall, terms, data_s = split_device(walls, roots, tp=1, data=data)
    us = 1e-6
    assert wall == pytest.approx(1100 * us) and data_s == pytest.approx(50 * us)  # the batches' CPU time per step
    assert terms["gemm"] == pytest.approx((150 + 140 + 160) * us)  # the backward's GEMMs are not "other"
    assert terms["attention"] == pytest.approx(80 * us) and terms["loss"] == pytest.approx(25 * us)
    assert terms["elementwise"] == pytest.approx((2 + 10) * us)
    assert terms["dp_param"] == pytest.approx(50 * us) and terms["optimizer"] == pytest.approx(70 * us)
    assert terms["other"] == pytest.approx((1100 - 687) * us)  # the wall less the device terms
    assert sum(terms.values()) == pytest.approx(wall) and set(terms) == set(STEP_TERMS)
    assert TermTimes(rank=0, step_s=wall, terms=terms, data_s=data_s).terms == terms


@pytest.mark.parametrize(("mm", "comm", "gemm", "dp_grad", "tp"), [
    (60, (50, 30), 60, 25, 15),  # the collectives overlap the GEMM: they keep what the wall leaves them
    (150, (20, 10), 100, 0, 0),  # the compute alone is past the wall: no communication, the rest scaled down
])
def test_overlapped_kernels_are_fitted_to_the_wall(mm: float, comm: tuple[float, float], gemm: float,
                                                   dp_grad: float, tp: float) -> None:
    """NCCL's kernels on their own stream beside the compute: the device terms sum past the 100 us step."""
    step = ev("autopar.step", 0, 100, ev("aten::mm", 1, 20, dev=mm),
              ev("autopar.dp_grad", 20, 40, ev("nccl:all_reduce", 21, 39, dev=comm[0])),
              ev("c10d::allreduce_", 40, 60, dev=comm[1]))
    wall, terms, _ = split_device(*device_trees(flat(step))[:2], tp=2)
    us = 1e-6
    assert terms["gemm"] == pytest.approx(gemm * us) and terms["other"] == 0
    assert terms["dp_grad"] == pytest.approx(dp_grad * us) and terms["tp"] == pytest.approx(tp * us)
    assert wall == pytest.approx(100 * us) and sum(terms.values()) == pytest.approx(wall)
    TermTimes(rank=0, step_s=wall, terms=terms)


def test_device_trees_read_the_real_profiler_s_events() -> None:
    """torch.profiler's own FunctionEvents (a CPU run: no device time) carry what :func:`device_trees` reads:
    the step windows are the labels' spans and the whole of the step is the device's idle time."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    w = torch.randn(16, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("autopar.data"):
                x = torch.randn(8, 16)
            with record_function("autopar.step"):
                (x @ w).relu().sum().backward()
    events = list(prof.events())
    spans = [e.time_range.end - e.time_range.start for e in events if e.name == "autopar.step"]
    walls, roots, data = device_trees(events)
    assert walls == pytest.approx(spans) and len(spans) == 2 and len(data) == 2
    assert [r.name for r in roots].count("autopar.step") == 2
    wall, terms, data_s = split_device(walls, roots, tp=1, data=data)
    assert wall > 0 and terms["other"] == pytest.approx(wall) and data_s > 0


def test_cpu_and_cuda_runs_are_profiled_and_other_devices_are_not() -> None:
    assert StepProfiler(2, 3, "cuda", 1).profiled(3) and StepProfiler(2, 3, "cpu", 1).profiled(3)
    assert not StepProfiler(2, 3, "mps", 1).profiled(3)
