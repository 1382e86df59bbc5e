"""The optimizer offload fraction as a plan dimension (issue 27 item 6): its memory and time terms by hand,
what each target runs and writes, and the search choosing a share where one fits faster than all."""

from __future__ import annotations

import pytest

from planner import targets
from planner.contracts import ParallelLayout, TrainingConfig
from planner.cost.comm import host_copy_time_s
from planner.cost.compute import memory_time_s
from planner.cost.memory import model_state_bytes, state_bytes_per_param
from planner.cost.predict import predict
from planner.cost.stage import optimizer_step_s
from planner.export import export_plan
from planner.presets import get_preset
from planner.reference import reference_profile
from planner.search import SearchOptions, search

TRAINING = TrainingConfig(seq_length=4096, global_batch_size=16)
STATE = state_bytes_per_param(TRAINING)


def test_the_gpu_keeps_the_share_not_offloaded_of_the_optimizer_states():
    """1e9 parameters, ZeRO-1 over 4 ranks: o/4 bytes each, half of it with half offloaded."""
    _, _, none = model_state_bytes(1e9, STATE, 1, 4, 0.0)
    _, _, half = model_state_bytes(1e9, STATE, 1, 4, 0.5)
    _, _, whole = model_state_bytes(1e9, STATE, 1, 4, 1.0)
    assert none == pytest.approx(1e9 * STATE.optimizer / 4)
    assert half == pytest.approx(none / 2) and whole == 0.0
    assert model_state_bytes(1e9, STATE, 1, 4, True) == model_state_bytes(1e9, STATE, 1, 4, 1.0)


def test_the_step_is_the_slower_of_the_gpu_share_and_the_host_share():
    profile = reference_profile("dgx-h100")
    local, b = 2e9, 16.0  # parameters on the rank, bytes the step moves per parameter
    cpu = profile.assumptions.cpu_optimizer_bytes_per_s

    def host(share: float) -> float:
        copies = (host_copy_time_s(profile, share * local * STATE.grads, to_device=False)
                  + host_copy_time_s(profile, share * local * STATE.weights, to_device=True))
        return copies + share * local * b / cpu

    gpu_all = memory_time_s(profile, local * b)
    assert optimizer_step_s(profile, STATE, b, 0.0, local) == (pytest.approx(gpu_all), 0.0)
    assert optimizer_step_s(profile, STATE, b, 1.0, local)[0] == pytest.approx(host(1.0))
    quarter, copies = optimizer_step_s(profile, STATE, b, 0.25, local)
    assert quarter == pytest.approx(max(memory_time_s(profile, 0.75 * local * b), host(0.25)))
    assert host(0.25) > memory_time_s(profile, 0.75 * local * b)  # the CPU is the slower side here
    assert copies == pytest.approx(host(0.25) - 0.25 * local * b / cpu)
    # the host's time scales with its share, but for each copy's fixed latency
    assert quarter == pytest.approx(host(1.0) / 4, rel=1e-3)


@pytest.mark.parametrize(("target", "zero", "refused"), [
    ("autopar", 3, "layout.optimizer_offload_fraction"),  # FSDP2 offloads whole shards
    ("deepspeed", 1, "optimizer_offload_fraction"),  # Twin-Flow's ratio is ZeRO-3's
    ("deepspeed", 3, None),
    ("megatron", 1, None),
])
def test_each_target_runs_a_share_or_names_why_not(target, zero, refused):
    layout = ParallelLayout(dp_shard=8, zero_stage=zero, offload_optimizer=True, optimizer_offload_fraction=0.5)
    found = targets.refusal(target, targets.Job(get_preset("llama3-8b"), TRAINING, layout))
    assert (found.field if found else None) == refused
    whole = layout.model_copy(update={"optimizer_offload_fraction": 1.0})
    assert targets.refusal(target, targets.Job(get_preset("llama3-8b"), TRAINING, whole)) is None


def test_megatron_writes_the_share():
    model, profile = get_preset("llama3-8b"), reference_profile("dgx-h100")
    layout = ParallelLayout(dp_shard=8, zero_stage=1, offload_optimizer=True, optimizer_offload_fraction=0.25)
    from planner.contracts import Plan

    plan = Plan(model=model, training=TRAINING, cluster=profile.name, num_gpus=8, layout=layout,
                precision=TRAINING.precision, target="megatron",
                prediction=predict(model, TRAINING, profile, layout, target="megatron"))
    script = "\n".join(export_plan(plan, "megatron").values())
    assert "--optimizer-cpu-offload" in script and "--optimizer-offload-fraction 0.25" in script


def test_a_share_without_offload_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="optimizer_offload_fraction=0.5 offloads nothing without offload_optimizer"):
        ParallelLayout(optimizer_offload_fraction=0.5)


def test_the_search_offloads_the_least_share_that_fits_where_the_target_can():
    """Llama 3 8B on 2 H100s for Megatron: the states do not fit unoffloaded; a quarter offloaded fits and
    steps faster than all of it (the host's step is the slow side). The executor gets whole offload only."""
    model, profile = get_preset("llama3-8b"), reference_profile("dgx-h100", gpus=2)
    plan = search(model, TRAINING, profile, SearchOptions(target="megatron", time_budget_s=20))
    lay = plan.layout
    assert lay.offload_optimizer and lay.optimizer_offload_fraction == 0.25
    assert plan.prediction.memory.fits
    whole = predict(model, TRAINING, profile, lay.model_copy(update={"optimizer_offload_fraction": 1.0}),
                    target="megatron")
    none = predict(model, TRAINING, profile, lay.model_copy(update={"offload_optimizer": False,
                                                                     "optimizer_offload_fraction": 1.0}),
                   target="megatron")
    assert plan.prediction.step_time_s < whole.step_time_s and not none.memory.fits
    mine = search(model, TRAINING, profile, SearchOptions(time_budget_s=20))
    assert mine.layout.offload_share in (0.0, 1.0)
    assert all(a.layout.offload_share in (0.0, 1.0) for a in mine.alternatives)


def test_a_failed_search_names_a_closest_layout_its_target_runs():
    """torchtitan runs no optimizer offload: Llama 3.1 8B on one H100 fits no layout, and the closest named is
    not an offloaded one (it was 'zero1 offload0.5' when the memory test came before the target's)."""
    from planner.errors import AutoparError

    training = TrainingConfig(seq_length=2048, global_batch_size=8)
    with pytest.raises(AutoparError) as err:
        search(get_preset("llama3.1-8b"), training, reference_profile("dgx-h100", gpus=1),
               SearchOptions(target="torchtitan"))
    closest = str(err.value).split("the closest (")[1].split(")")[0]
    assert closest.startswith("tp") and "offload" not in closest
