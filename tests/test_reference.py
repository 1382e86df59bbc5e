"""planner/reference.py (reference ClusterProfiles from hardware.csv + calibration.json) and the
contract layer they produce: JSON schemas, JSON round trips and the ClusterProfile link check."""

from __future__ import annotations

import csv
import json
import re
from importlib import resources

import pytest
from pydantic import ValidationError

from planner.contracts import (
    ClusterProfile,
    Collective,
    LinkLevel,
    ParallelLayout,
    Plan,
    Precision,
    Recompute,
    TrainingConfig,
    json_schemas,
)
from planner.cost.predict import predict
from planner.errors import AutoparError, UnknownNameError
from planner.presets import get_preset
from planner.reference import ALIASES, SYSTEMS, list_systems, reference_profile

GiB = 2**30
CALIBRATION = json.loads(resources.files("planner").joinpath("data/calibration.json").read_text())


@pytest.fixture(params=list(SYSTEMS))
def system(request) -> str:
    return request.param


# ---------------------------------------------------------------- every system
def test_every_system_builds_a_reference_profile(system):
    p = reference_profile(system)
    assert p.kind == "reference"
    assert p.name == system
    assert p.num_nodes == 1 and p.gpus_per_node == SYSTEMS[system].gpus_per_node == 8
    assert p.device.name == SYSTEMS[system].gpu_row
    assert p.device.peak_tflops[Precision.bf16] > 0
    assert p.device.peak_tflops[Precision.fp16] == p.device.peak_tflops[Precision.bf16]
    assert p.device.memory_bytes > 0 and p.device.hbm_bandwidth_bytes_per_s > 0
    levels = {link.level for link in p.links}
    assert levels == {LinkLevel.intra_node, LinkLevel.inter_node, LinkLevel.host_device}
    assert any("hardware.csv" in s for s in p.sources)


def test_list_systems_and_aliases():
    assert list_systems() == list(SYSTEMS)
    for alias, key in ALIASES.items():
        assert key in SYSTEMS
        assert reference_profile(alias).name == key
    assert reference_profile("DGX-H100").name == "dgx-h100"  # case-insensitive


# ---------------------------------------------------------------- device figures from hardware.csv
@pytest.mark.parametrize(
    ("system", "bf16", "memory_gib", "hbm_tb_s"),
    [
        ("dgx-a100-80gb", 312, 80, 2.039),
        ("dgx-a100-40gb", 312, 40, 1.555),
        ("dgx-h100", 989.4, 80, 3.35),
        ("hgx-h200", 989, 141, 4.8),
        ("hgx-h800", 989.4, 80, 3.35),
        ("gt-h100-96gb-500w", (989.4 + 835.0) / 2, 96, 2.4),
        ("dgx-b200", 2250, 180, 8.0),
    ],
)
def test_device_figures(system, bf16, memory_gib, hbm_tb_s):
    d = reference_profile(system).device
    assert d.peak_tflops[Precision.bf16] == pytest.approx(bf16)
    assert d.memory_bytes == memory_gib * GiB
    assert d.hbm_bandwidth_bytes_per_s == pytest.approx(hbm_tb_s * 1e12)


def test_fp8_peaks():
    assert Precision.fp8 not in reference_profile("dgx-a100-80gb").device.peak_tflops  # A100 has no FP8
    assert reference_profile("dgx-h100").device.peak_tflops[Precision.fp8] == pytest.approx(1978.9)
    assert reference_profile("dgx-b200").device.peak_tflops[Precision.fp8] == pytest.approx(4500)
    # H200 row gives no FP8 figure: twice the bf16 peak
    assert reference_profile("hgx-h200").device.peak_tflops[Precision.fp8] == pytest.approx(2 * 989)


# ---------------------------------------------------------------- nodes and links
def test_num_nodes_scales_num_gpus(system):
    for n in (1, 2, 16):
        p = reference_profile(system, n)
        assert p.num_nodes == n and p.num_gpus == 8 * n
    assert reference_profile(system).with_nodes(4).num_gpus == 32


def test_inter_node_busbw_is_nic_line_rate_times_efficiency(system):
    p = reference_profile(system, 2)
    inter = [link for link in p.links if link.level is LinkLevel.inter_node]
    assert {link.collective for link in inter} >= {Collective.all_reduce, Collective.all_gather,
                                                   Collective.reduce_scatter, Collective.all_to_all, Collective.p2p}
    expected = SYSTEMS[system].nic_gbit_per_gpu / 8 * 0.95 * 1e9
    for link in inter:
        assert link.busbw_bytes_per_s == pytest.approx(expected)


def _hardware_rows() -> list[dict[str, str]]:
    with resources.files("planner").joinpath("data/hardware.csv").open(encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_inter_node_busbw_agrees_with_nccl_tests_figures_in_hardware_csv():
    """The network busBW of the reference profiles against the measurements hardware.csv records
    (not against the efficiency constant that produces it)."""
    rows = _hardware_rows()
    # DGX A100, 8x 200 Gb/s HDR per node: nccl-tests all-reduce busBW 192 GB/s per node (NCCL #812),
    # i.e. 192 / 8 GPUs = 24 GB/s per GPU's NIC
    dgx_a100 = next(r for r in rows if r["name"] == "DGX A100" and r["scope"] == "inter-node")
    assert "8x 200 Gb/s" in dgx_a100["form_factor_or_system"]
    per_gpu_a100 = float(dgx_a100["measured_busbw_gb_s"]) / 8
    assert per_gpu_a100 == 24.0
    a100 = [link for link in reference_profile("dgx-a100-80gb", 2).links if link.level is LinkLevel.inter_node]
    assert a100
    for link in a100:
        assert abs(link.busbw_bytes_per_s / 1e9 - per_gpu_a100) <= 0.05 * per_gpu_a100, link.collective
    # DGX H100, 400 Gb/s NDR per GPU: NVIDIA expects 46-48 GB/s per NIC (nccl-tests #290)
    ndr = next(r for r in rows if "per NIC" in r["measured_other"] and "NDR 400" in r["measured_other"])
    low, high = (float(x) for x in re.search(r"(\d+)-(\d+)\s*GB/s per NIC", ndr["measured_other"]).groups())
    assert (low, high) == (46.0, 48.0)
    h100 = [link for link in reference_profile("dgx-h100", 2).links if link.level is LinkLevel.inter_node]
    assert h100
    for link in h100:
        assert low * 1e9 <= link.busbw_bytes_per_s <= high * 1e9, link.collective


def test_network_figures_by_hand():
    a100 = [link for link in reference_profile("dgx-a100-80gb", 2).links if link.level is LinkLevel.inter_node]
    h100 = [link for link in reference_profile("dgx-h100", 2).links if link.level is LinkLevel.inter_node]
    assert all(link.busbw_bytes_per_s == pytest.approx(23.75e9) for link in a100)  # 200 Gb/s HDR
    assert all(link.busbw_bytes_per_s == pytest.approx(47.5e9) for link in h100)  # 400 Gb/s NDR


def test_intra_node_all_reduce_busbw():
    p = reference_profile("dgx-h100")
    ar = [link for link in p.links if link.level is LinkLevel.intra_node and link.collective is Collective.all_reduce]
    assert len(ar) == 1 and ar[0].busbw_bytes_per_s == pytest.approx(476e9)


def test_nic_override():
    p = reference_profile("dgx-h100", 4, nic_gbit_per_gpu=100)
    assert p.name == "dgx-h100-nic100"
    inter = [link for link in p.links if link.level is LinkLevel.inter_node]
    assert inter and all(link.busbw_bytes_per_s == pytest.approx(100 / 8 * 0.95 * 1e9) for link in inter)
    assert all("100 Gb/s" in link.source for link in inter)
    # intra-node links do not change
    base = reference_profile("dgx-h100", 4)
    intra = lambda prof: [(lnk.collective, lnk.busbw_bytes_per_s)  # noqa: E731
                          for lnk in prof.links if lnk.level is LinkLevel.intra_node]
    assert intra(p) == intra(base)


# ---------------------------------------------------------------- assumptions
def test_assumption_notes_say_where_figures_come_from(system):
    notes = reference_profile(system).assumptions.notes
    assert notes and all(n.strip() for n in notes)
    text = "\n".join(notes)
    assert "fitted on" in text  # calibrated constants name their data
    assert "alpha" in text and "network efficiency" in text
    assert "nccl-tests" in text or "measurements" in text or "assumed" in text


def test_fitted_constants_from_calibration_json_are_applied(system):
    family = SYSTEMS[system].family
    fitted = {**CALIBRATION.get("shared", {}), **CALIBRATION["families"][family]}
    a = reference_profile(system).assumptions
    assert fitted, f"calibration.json has nothing for {family}"
    for key, value in fitted.items():
        assert getattr(a, key) == pytest.approx(value), key
    assert a.matmul_efficiency == pytest.approx(CALIBRATION["families"][family]["matmul_efficiency"])
    assert any(key in n for n in a.notes for key in fitted)


def test_a100_and_hopper_calibrations_differ():
    a100 = reference_profile("dgx-a100-80gb").assumptions
    hopper = reference_profile("dgx-h100").assumptions
    assert a100.matmul_efficiency == pytest.approx(CALIBRATION["families"]["a100"]["matmul_efficiency"])
    assert hopper.matmul_efficiency == pytest.approx(CALIBRATION["families"]["hopper"]["matmul_efficiency"])
    assert a100.matmul_efficiency != hopper.matmul_efficiency


# ---------------------------------------------------------------- bad input
def test_unknown_cluster_lists_the_systems():
    with pytest.raises(UnknownNameError) as err:
        reference_profile("tpu-v4")
    assert set(err.value.known) == set(SYSTEMS)
    message = str(err.value)
    assert "cluster='tpu-v4'" in message
    for name in SYSTEMS:
        assert name in message


@pytest.mark.parametrize("nodes", [0, -1])
def test_non_positive_node_count(nodes):
    with pytest.raises(AutoparError) as err:
        reference_profile("dgx-h100", nodes)
    assert f"nodes={nodes}" in str(err.value)


# ---------------------------------------------------------------- contracts
CONTRACT_NAMES = ["ModelSpec", "TrainingConfig", "ClusterProfile", "Plan", "Prediction", "TrainingGoal", "RunReport"]


def test_json_schemas_has_every_contract():
    schemas = json_schemas()
    assert sorted(schemas) == sorted(CONTRACT_NAMES)
    for name, schema in schemas.items():
        assert schema["title"] == name
        json.dumps(schema)  # serialisable


@pytest.mark.parametrize(
    "name",
    CONTRACT_NAMES,
)
def test_every_contract_schema_has_a_schema_version(name):
    schema = json_schemas()[name]
    assert "schema_version" in schema["properties"]
    assert (
        schema["properties"]["schema_version"].get("const", schema["properties"]["schema_version"].get("default"))
        == "1"
    )


def test_cluster_profile_round_trips_through_json(system):
    p = reference_profile(system, 2, nic_gbit_per_gpu=200)
    back = ClusterProfile.model_validate_json(p.model_dump_json())
    assert back == p
    assert back.num_gpus == 16 and back.assumptions.notes == p.assumptions.notes


def test_plan_round_trips_through_json():
    model = get_preset("llama3-8b")
    training = TrainingConfig(seq_length=2048, global_batch_size=16)
    profile = reference_profile("dgx-h100")
    layout = ParallelLayout(dp_shard=4, tp=2, sp=True, zero_stage=1, micro_batch_size=2, recompute=Recompute.selective)
    plan = Plan(
        model=model,
        training=training,
        cluster=profile.name,
        num_gpus=profile.num_gpus,
        layout=layout,
        precision=training.precision,
        prediction=predict(model, training, profile, layout),
    )
    back = Plan.model_validate_json(plan.model_dump_json())
    assert back == plan
    assert back.prediction.step_time_s == plan.prediction.step_time_s


def test_multi_node_profile_without_inter_node_link_is_rejected():
    p = reference_profile("dgx-h100", 1)
    data = p.model_dump(mode="json")
    data["num_nodes"] = 2
    data["links"] = [link for link in data["links"] if link["level"] != "inter_node"]
    with pytest.raises(ValidationError) as err:
        ClusterProfile.model_validate(data)
    assert "inter_node" in str(err.value)
    assert "num_nodes=2" in str(err.value)
    # one node needs no network
    data["num_nodes"] = 1
    assert ClusterProfile.model_validate(data).num_gpus == 8


def test_cluster_profile_rejects_unknown_fields():
    data = reference_profile("dgx-h100").model_dump(mode="json")
    data["gpus"] = 8
    with pytest.raises(ValidationError, match="gpus"):
        ClusterProfile.model_validate(data)


def test_a_job_on_part_of_a_node_or_on_whole_nodes():
    from planner.errors import AutoparError
    from planner.reference import reference_profile

    part = reference_profile("dgx-h100", gpus=4)  # 4 of a node's 8 GPUs, a 4-GPU workstation
    assert (part.num_nodes, part.gpus_per_node, part.num_gpus) == (1, 4, 4)
    assert reference_profile("dgx-h100", gpus=16).num_nodes == 2
    with pytest.raises(AutoparError, match="gpus=12 .*multiple of 8"):
        reference_profile("dgx-h100", gpus=12)
