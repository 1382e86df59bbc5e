"""Reference cluster profiles: datasheet peaks and published collective bandwidths, no measurement.

The device figures are read from ``planner/data/hardware.csv`` (a copy of the project's
``shared/data/hardware.csv``: datasheets and nccl-tests results with their sources). The node
designs below say which NVLink/NIC figures apply; every number that is an assumption rather than a
datasheet or measurement is written into the profile's ``assumptions.notes``. Calibrated
efficiencies come from ``planner/data/calibration.json``, which ``benchmarks/validate_published.py
--fit`` writes.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from planner.contracts import (
    Assumptions,
    ClusterProfile,
    Collective,
    DeviceSpec,
    LinkLevel,
    LinkProfile,
    Precision,
)
from planner.errors import AutoparError, UnknownNameError

GB = 1e9
"""Bandwidths are decimal (GB/s); HBM capacities are GiB as the vendors mean them (80 GB = 80 GiB)."""
NETWORK_EFFICIENCY = 0.95
"""Achieved / line-rate bus bandwidth of one NIC: nccl-tests 24 GB/s on 200 Gb/s HDR (25 GB/s) and
46–48 GB/s on 400 Gb/s NDR (50 GB/s) per hardware.csv."""


@dataclass(frozen=True)
class NodeDesign:
    """How one node of a system is built: which GPU, its interconnects and the figures that apply."""

    key: str
    title: str
    gpu_row: str  # `name` in hardware.csv
    family: str  # calibration family
    gpus_per_node: int
    sm_count: int
    intra_all_reduce_gb_s: float  # nccl-tests busBW, all-reduce, within the node
    intra_other_gb_s: float  # busBW of all-gather / reduce-scatter / all-to-all / p2p within the node
    nic_gbit_per_gpu: float  # network line rate per GPU
    host_link_gb_s: float  # pinned host<->device copy bandwidth
    memory_gb: float | None = None  # override the datasheet capacity (e.g. DGX B200's 180 GB)
    hbm_tb_s: float | None = None  # override / fill in the datasheet HBM bandwidth
    peak_bf16_override: float | None = None
    notes: tuple[str, ...] = ()


SYSTEMS: dict[str, NodeDesign] = {
    d.key: d
    for d in (
        NodeDesign("dgx-a100-40gb", "DGX A100 (8x A100 40GB, NVSwitch, 8x HDR 200 Gb/s)", "A100 40GB", "a100", 8, 108,
                   232.0, 232.0, 200, 24.0,
                   notes=("intra-node busBW 232 GB/s: nccl-tests issue #175 (HGX A100, all_reduce_perf)",
                          "network: 8x 200 Gb/s HDR per node = 192 GB/s all-reduce busBW (NCCL issue #812)",
                          "host link: PCIe 4.0 x16, assumed 24 GB/s pinned")),
        NodeDesign("dgx-a100-80gb", "DGX A100 (8x A100 80GB, NVSwitch, 8x HDR 200 Gb/s)", "A100 80GB", "a100", 8, 108,
                   232.0, 232.0, 200, 24.0,
                   notes=("intra-node busBW 232 GB/s: nccl-tests issue #175 (HGX A100, all_reduce_perf)",
                          "network: 8x 200 Gb/s HDR per node = 192 GB/s all-reduce busBW (NCCL issue #812)",
                          "host link: PCIe 4.0 x16, assumed 24 GB/s pinned")),
        NodeDesign("dgx-h100", "DGX H100 (8x H100 SXM 80GB, NVLink4 + NVSwitch, 8x NDR 400 Gb/s)", "H100", "hopper", 8,
                   132, 476.0, 370.0, 400, 50.0,
                   notes=("intra-node all-reduce busBW 476 GB/s with NVLS (nccl-tests #290, #212)",
                          "other intra-node collectives ~370 GB/s (450 GB/s NVLink minus ~20% protocol, "
                          "nccl-tests #212)",
                          "network: 400 Gb/s NDR per GPU, 46-48 GB/s measured (nccl-tests #290)",
                          "host link: PCIe 5.0 x16, assumed 50 GB/s pinned")),
        NodeDesign("hgx-h200", "HGX H200 (8x H200 141GB, NVLink4 + NVSwitch, 400 Gb/s per GPU)", "H200", "hopper", 8,
                   132, 476.0, 370.0, 400, 50.0,
                   notes=("H200 has H100's NVLink4 and compute; link figures taken from DGX H100 measurements",
                          "host link: PCIe 5.0 x16, assumed 50 GB/s pinned")),
        NodeDesign("hgx-h800", "HGX H800 (8x H800 80GB, reduced NVLink, 400 Gb/s IB per GPU)", "H800", "hopper", 8, 132,
                   215.0, 160.0, 400, 50.0, memory_gb=80, hbm_tb_s=3.35, peak_bf16_override=989.4,
                   notes=("H800 compute, memory and HBM bandwidth assumed equal to H100 SXM "
                          "(the export variant differs in NVLink)",
                          "intra-node all-reduce busBW 215 GB/s (NCCL issue #1374); 160 GB/s usable NVLink and "
                          "50 GB/s IB per GPU (DeepSeek-V3 report 3.2.2)")),
        NodeDesign("gt-h100-96gb-500w", "Grand Teton (8x H100 96GB HBM2e at 500 W, 400 Gb/s RDMA per GPU)",
                   "H100 (Meta Grand Teton variant)", "hopper", 8, 132, 476.0, 370.0, 400, 50.0,
                   peak_bf16_override=(989.4 + 835.0) / 2,
                   notes=("peak: hardware.csv says the 500 W part lies between H100 NVL (835) and SXM (989.4) "
                          "TFLOP/s; the midpoint, 912, is assumed",
                          "links taken from DGX H100 measurements")),
        NodeDesign("dgx-b200", "DGX B200 (8x B200, NVLink5 + NVSwitch, 400 Gb/s per GPU)", "B200", "blackwell", 8, 148,
                   952.0, 740.0, 400, 50.0, memory_gb=180,
                   notes=("intra-node busBW assumed 2x DGX H100's measured (NVLink5 1.8 TB/s vs NVLink4 900 GB/s); "
                          "no measurement in hardware.csv",
                          "memory 180 GB per GPU (DGX B200: 1,440 GB per 8 GPUs)",
                          "host link: PCIe 5.0 x16, assumed 50 GB/s pinned")),
    )
}

ALIASES = {
    "a100": "dgx-a100-80gb", "a100-80gb": "dgx-a100-80gb", "a100-40gb": "dgx-a100-40gb", "h100": "dgx-h100",
    "h200": "hgx-h200", "dgx-h200": "hgx-h200", "b200": "dgx-b200", "h800": "hgx-h800",
}

_NUMBER = re.compile(r"[-+]?\d[\d,]*\.?\d*")


def _leading_number(text: str) -> float | None:
    match = _NUMBER.search(text or "")
    return float(match.group().replace(",", "")) if match else None


@lru_cache(maxsize=1)
def hardware_rows() -> dict[str, dict[str, str]]:
    """``accelerator_spec`` rows of hardware.csv keyed by name."""
    text = resources.files("planner").joinpath("data/hardware.csv").read_text()
    return {r["name"]: r for r in csv.DictReader(text.splitlines()) if r["record_type"] == "accelerator_spec"}


@lru_cache(maxsize=1)
def calibration() -> dict:
    """Fitted efficiencies per GPU family (written by benchmarks/validate_published.py --fit)."""
    path = resources.files("planner").joinpath("data/calibration.json")
    return json.loads(path.read_text()) if path.is_file() else {}


def device_spec(design: NodeDesign) -> DeviceSpec:
    row = hardware_rows()[design.gpu_row]
    bf16 = design.peak_bf16_override or _leading_number(row["peak_dense_bf16_fp16_tflops"])
    fp8 = _leading_number(row["peak_dense_fp8_tflops"]) or (2 * bf16 if design.family != "a100" else None)
    memory_gb = design.memory_gb or _leading_number(row["hbm_capacity_gb"])
    hbm = design.hbm_tb_s or _leading_number(row["hbm_bandwidth_tb_s"])
    peaks = {Precision.bf16: bf16, Precision.fp16: bf16, Precision.fp32: bf16 / 2}
    if fp8:
        peaks[Precision.fp8] = fp8
    return DeviceSpec(
        name=design.gpu_row, memory_bytes=int(memory_gb * 2**30), peak_tflops=peaks,
        hbm_bandwidth_bytes_per_s=hbm * 1e12, sm_count=design.sm_count, tdp_w=_leading_number(row["tdp_w"]),
    )


def assumptions_for(family: str, fitted: dict | None = None) -> Assumptions:
    """Efficiency assumptions of a GPU family: contract defaults overridden by a calibration
    document (``fitted``; the packaged ``calibration.json`` when None, none at all when ``{}``)."""
    doc = calibration() if fitted is None else fitted
    values = {**doc.get("shared", {}), **doc.get("families", {}).get(family, {})}
    notes = [f"{k}={v:.3f} fitted on shared/data/published_runs.csv ({doc.get('fitted_on', '?')})"
             for k, v in values.items()]
    return Assumptions(**values, notes=notes)


def gpus_to_nodes(system: str, gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of a job on ``gpus`` GPUs of ``system``: part of one node (a 4-GPU job on an
    8-GPU node, a workstation), or whole nodes."""
    if gpus < 1:
        raise AutoparError("gpus", gpus, "give at least 1 GPU", problem="is not a positive GPU count")
    if gpus <= gpus_per_node:
        return 1, gpus
    if gpus % gpus_per_node:
        raise AutoparError("gpus", gpus, f"use at most {gpus_per_node} GPUs (part of one node) or a multiple of "
                           f"{gpus_per_node} (whole nodes), e.g. {gpus // gpus_per_node * gpus_per_node}",
                           problem=f"is more than one {system} node holds but not whole nodes")
    return gpus // gpus_per_node, gpus_per_node


def on_gpus(profile: ClusterProfile, gpus: int) -> ClusterProfile:
    """``profile`` on ``gpus`` GPUs: part of one node (``gpus_per_node`` cut, renamed ``<name>-<n>gpu``: a
    4-GPU job on an 8-GPU node is another machine than the node) or whole nodes (:meth:`ClusterProfile.with_nodes`);
    as it is when it has ``gpus`` already. Only a reference profile can be resized: a measured one describes
    the machines it was measured on (AutoparError naming ``gpus``). A profile already cut from a node
    (``dgx-h100-5gpu``) is cut again under the node's name (``dgx-h100-4gpu``)."""
    if gpus == profile.num_gpus:
        return profile
    if profile.kind == "measured":
        raise AutoparError("gpus", gpus, f"omit gpus (this measured profile describes {profile.num_gpus} GPUs) or "
                           "use a profile measured on the machines you plan for",
                           problem="cannot change a measured profile")
    system = re.sub(r"-\d+gpu$", "", profile.name)  # part of a node cut again: from the node, not the cut
    nodes, per_node = gpus_to_nodes(system, gpus, profile.gpus_per_node)
    if per_node < profile.gpus_per_node:
        return ClusterProfile.model_validate({**profile.model_dump(), "gpus_per_node": per_node, "num_nodes": 1,
                                              "name": f"{system}-{per_node}gpu"})
    return profile.with_nodes(nodes)


def reference_profile(
    system: str, num_nodes: int = 1, *, nic_gbit_per_gpu: float | None = None, fitted: dict | None = None,
    gpus: int | None = None,
) -> ClusterProfile:
    """A reference ClusterProfile of ``num_nodes`` nodes of ``system`` (see :data:`SYSTEMS`), or of
    ``gpus`` GPUs (part of one node, or whole nodes; then ``num_nodes`` is not used).

    ``nic_gbit_per_gpu`` replaces the design's network line rate (clusters built with fewer or
    slower NICs than the reference design); ``fitted`` replaces the packaged calibration
    (``{}``: the contract's uncalibrated defaults).
    """
    key = ALIASES.get(system.lower(), system.lower())
    if key not in SYSTEMS:
        raise UnknownNameError("cluster", system, list(SYSTEMS))
    if num_nodes < 1:
        raise AutoparError("nodes", num_nodes, "give at least 1 node", problem="is not a positive node count")
    if gpus is not None:
        return on_gpus(reference_profile(key, 1, nic_gbit_per_gpu=nic_gbit_per_gpu, fitted=fitted), gpus)
    d = SYSTEMS[key]
    nic = nic_gbit_per_gpu or d.nic_gbit_per_gpu
    net = nic / 8 * NETWORK_EFFICIENCY * GB
    intra_ar, intra = d.intra_all_reduce_gb_s * GB, d.intra_other_gb_s * GB
    links = [
        LinkProfile(level=LinkLevel.intra_node, collective=Collective.all_reduce, alpha_s=12e-6,
                    busbw_bytes_per_s=intra_ar, source="nccl-tests busBW, hardware.csv"),
    ]
    for coll in (Collective.all_gather, Collective.reduce_scatter, Collective.all_to_all, Collective.p2p):
        links.append(LinkProfile(level=LinkLevel.intra_node, collective=coll, alpha_s=10e-6, busbw_bytes_per_s=intra,
                                 source="nccl-tests busBW, hardware.csv"))
    for coll in (Collective.all_reduce, Collective.all_gather, Collective.reduce_scatter, Collective.all_to_all,
                 Collective.p2p):
        links.append(LinkProfile(level=LinkLevel.inter_node, collective=coll, alpha_s=25e-6, busbw_bytes_per_s=net,
                                 source=f"{nic:g} Gb/s per GPU x {NETWORK_EFFICIENCY} achieved"))
    for coll in (Collective.host_to_device, Collective.device_to_host):
        links.append(LinkProfile(level=LinkLevel.host_device, collective=coll, alpha_s=10e-6,
                                 busbw_bytes_per_s=d.host_link_gb_s * GB, source="PCIe, assumed"))
    assumptions = assumptions_for(d.family, fitted)
    assumptions.notes = list(d.notes) + [
        "alpha (latency): 10-12 us within a node, 25 us across nodes (assumed, typical NCCL small-message times)",
        f"network efficiency {NETWORK_EFFICIENCY}: nccl-tests busBW / NIC line rate",
    ] + assumptions.notes
    return ClusterProfile(
        kind="reference", name=key + (f"-nic{nic:g}" if nic != d.nic_gbit_per_gpu else ""), device=device_spec(d),
        gpus_per_node=d.gpus_per_node, num_nodes=num_nodes, links=links, assumptions=assumptions,
        sources=["planner/data/hardware.csv (copy of shared/data/hardware.csv)"],
    )


# The SXM parts SYSTEMS describes, by the model number in the name CUDA reports ("NVIDIA H200",
# "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB") and, where one number has two parts, another
# word of it; checked in this order, as whole words (GH200 and GB200 are other chips; an RTX A1000 is
# no A100). Not matched: PCIe and NVL cards (H100 PCIe 756, NVL 835 dense bf16 TFLOP/s against SXM's
# 989) and MIG slices (a fraction of the GPU), whose peaks the datasheets here do not give.
_CUDA_NAMES = (("a100", "40gb", "dgx-a100-40gb"), ("a100", "", "dgx-a100-80gb"),
               ("h100", "96gb", "gt-h100-96gb-500w"), ("h100", "", "dgx-h100"), ("h200", "", "hgx-h200"),
               ("h800", "", "hgx-h800"), ("b200", "", "dgx-b200"))
_NOT_SXM = ("pcie", "nvl", "mig")


def datasheet_for(device_name: str) -> tuple[str, DeviceSpec] | None:
    """(system key, datasheet DeviceSpec) of the GPU CUDA names ``device_name``, or None where the
    name is not an SXM part of :data:`SYSTEMS` (a PCIe or NVL card, a MIG slice, another GPU)."""
    words = re.findall(r"[a-z0-9]+", device_name.lower())
    if any(w.startswith(bad) for w in words for bad in _NOT_SXM):
        return None
    for number, also, key in _CUDA_NAMES:
        if number in words and (not also or also in words):
            return key, device_spec(SYSTEMS[key])
    return None


def system_family(system: str) -> str:
    return SYSTEMS[ALIASES.get(system.lower(), system.lower())].family


def list_systems() -> list[str]:
    return list(SYSTEMS)


def measured_profiles() -> list[ClusterProfile]:
    """The measured profiles shipped with the planner (``planner/data/measured/*.json``: written by
    ``autopar profile`` on real machines, e.g. one NVIDIA H200), in file-name order."""
    folder = resources.files("planner").joinpath("data/measured")
    if not folder.is_dir():
        return []
    return [ClusterProfile.model_validate_json(f.read_text())
            for f in sorted(folder.iterdir(), key=lambda f: f.name) if f.name.endswith(".json")]
