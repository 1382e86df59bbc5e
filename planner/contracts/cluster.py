"""ClusterProfile: who was measured and what — compute tables and link bandwidths per level.

A profile is *measured* (written by ``profiler/`` on real machines) or *reference* (built from
datasheets and published collective measurements). Reference profiles carry the efficiency
assumptions that turn datasheet peaks into achieved speed, in :class:`EfficiencyAssumptions`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from datetime import UTC, datetime
from enum import Enum
from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator, model_validator

from planner.contracts.common import SCHEMA_VERSION, ClusterName, Contract, Name, PlausibleDate, Precision
from planner.contracts.limits import MAX_DEVICE_MEMORY_BYTES, MAX_GPUS, MAX_GPUS_PER_NODE, MAX_SM_COUNT
from planner.contracts.terms import unknown_terms

MAX_TFLOPS = 1e5  # TFLOP/s of one device: 100 PFLOP/s, far above any datasheet
MAX_MEMORY_BW = 1e14  # bytes/s of one device's memory: 100 TB/s


class LinkLevel(str, Enum):
    intra_node = "intra_node"
    inter_node = "inter_node"
    host_device = "host_device"


class Collective(str, Enum):
    all_reduce = "all_reduce"
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"
    all_to_all = "all_to_all"
    p2p = "p2p"
    host_to_device = "host_to_device"
    device_to_host = "device_to_host"


class DeviceSpec(Contract):
    name: Name
    memory_bytes: int = Field(gt=0, le=MAX_DEVICE_MEMORY_BYTES, strict=True)
    peak_tflops: dict[Precision, Annotated[float, Field(gt=0, le=MAX_TFLOPS)]] = Field(
        description="dense datasheet peak per precision, TFLOP/s (at most 100,000: a device is not 100 PFLOP/s)")
    hbm_bandwidth_bytes_per_s: float = Field(gt=0, le=MAX_MEMORY_BW, description="bytes/s (at most 100 TB/s)")
    sm_count: int | None = Field(None, gt=0, le=MAX_SM_COUNT, strict=True,
                                 description="streaming multiprocessors (wave quantisation)")
    tdp_w: float | None = Field(None, gt=0, le=1e5)

    @model_validator(mode="after")
    def _peaks(self) -> DeviceSpec:
        if Precision.bf16 not in self.peak_tflops and Precision.fp16 not in self.peak_tflops:
            raise ValueError(
                f"peak_tflops={ {k.value: v for k, v in self.peak_tflops.items()} } has no bf16/fp16 entry; "
                "give the dense 16-bit peak in TFLOP/s, e.g. {'bf16': 989.4}"
            )
        bad = {k.value: v for k, v in self.peak_tflops.items() if not v > 0}
        if bad:
            raise ValueError(f"peak_tflops={bad} must be positive TFLOP/s")
        return self


class Environment(Contract):
    hostnames: list[str] = Field(default_factory=list)  # the hosts (a profile: one per node, its first rank's)
    driver_version: str | None = None
    cuda_version: str | None = None
    torch_version: str | None = None
    nccl_version: str | None = None
    gloo_version: str | None = Field(
        None, description="gloo has no releases of its own: torch vendors it at a commit, so this names the torch "
        "build that carries it (version and build commit)")
    backend: Literal["nccl", "gloo", "none"] = "none"
    devices_per_node: int | None = Field(
        None, ge=1, description="GPUs on rank 0's node (torch.cuda.device_count()), on a CPU the CPUs its process "
        "may use; may exceed the ranks per node profiled")


FLAT_BUSBW_BYTES_PER_S = 1e15  # LinkProfile.is_flat: at or above this a fit's bandwidth term is nil


MAX_BUSBW = 1e13  # bytes/s of one link: 10 TB/s, over five times NVLink 5's 1.8 TB/s per GPU
MAX_ALPHA_S = 10.0  # a collective's latency; longer is a hung rank, not a link
MIN_FLAT_SLOPE = 1e-18  # s/byte: the profiler's nil slope (profiler/fit.py MIN_SLOPE), a bus bandwidth of 1e18
MAX_FLAT_BUSBW = 1.001 / MIN_FLAT_SLOPE  # the flat mark and its float rounding; above: a typo, not a fit


class TimedPoint(Contract):
    bytes: int = Field(ge=0, le=2**50)
    time_s: float = Field(gt=0, le=3600)


class LinkProfile(Contract):
    """One collective on one link level: α-β model ``t = alpha_s + bytes * factor / busbw``.

    ``busbw_bytes_per_s`` is nccl-tests *bus* bandwidth, so the same value describes ring
    all-reduce (factor 2(n-1)/n), all-gather / reduce-scatter ((n-1)/n) and point-to-point (1).
    For ``inter_node`` it is the bandwidth of one GPU's share of the network (one NIC per GPU on
    rail-optimised DGX/HGX fabrics); a group with g members per node gets g times it.

    A link may be *piecewise*: several entries of the same level, collective and group size, each
    covering the message sizes ``min_bytes <= bytes < max_bytes`` (``None`` = unbounded on that
    side), for transports that change regime with size (eager vs rendezvous, in-cache vs out of
    cache). Entries without bounds cover every size, as before. The planner prices a message with
    the segment that covers it, else the nearest one. The profiler stores all of the link's points
    on each segment (each segment's fit used those in its range; ``fit_r2`` is over those).

    ``ranks_per_node`` says how the measured group sat (the profiler records it): an ``inter_node``
    entry with ``group_size`` n and ``ranks_per_node`` g is the measured time of exactly such a group,
    its on-node legs included, and prices it as measured (:func:`planner.cost.comm.collective_time_s`).
    """

    level: LinkLevel
    collective: Collective
    group_size: int | None = Field(None, ge=1, description="ranks measured; None = applies to any size")
    alpha_s: float = Field(ge=0, le=MAX_ALPHA_S, description="latency per collective call")
    busbw_bytes_per_s: float = Field(gt=0, description="bus bandwidth, bytes/s: at most 10 TB/s (NVLink 5 moves "
                                     "1.8 TB/s per GPU), or the profiler's flat-fit mark (1e15 to 1e18: latency "
                                     "alone, is_flat)")
    points: list[TimedPoint] = Field(default_factory=list, description="measurements the fit came from")
    fit_r2: float | None = None
    source: str = ""
    min_bytes: int | None = Field(None, ge=0,
                                  description="smallest message this segment covers (inclusive); None = any")
    max_bytes: int | None = Field(None, gt=0, description="message size this segment stops at (exclusive); None = any")
    ranks_per_node: int | None = Field(
        None, ge=1, description="members of the measured group on each node; None = not recorded. An inter_node "
        "entry measured at exactly a group's size and placement already holds its on-node legs, so the planner "
        "does not bound it by the intra_node link again")

    @field_validator("busbw_bytes_per_s")
    @classmethod
    def _plausible_bandwidth(cls, v: float) -> float:
        if MAX_BUSBW < v < FLAT_BUSBW_BYTES_PER_S or v > MAX_FLAT_BUSBW:
            raise ValueError(f"is {v:.3g} B/s: no link moves more than {MAX_BUSBW:.0e} B/s (10 TB/s); give the "
                             f"measured bus bandwidth in bytes per second (a latency-only fit is stored as "
                             f"{1 / MIN_FLAT_SLOPE:.0e})")
        return v

    @model_validator(mode="after")
    def _range(self) -> LinkProfile:
        if self.min_bytes is not None and self.max_bytes is not None and not self.min_bytes < self.max_bytes:
            raise ValueError(
                f"{self.level.value} {self.collective.value} segment has min_bytes={self.min_bytes} >= "
                f"max_bytes={self.max_bytes}; a segment covers min_bytes <= bytes < max_bytes, so min must be below max"
            )
        return self

    @property
    def segmented(self) -> bool:
        return self.min_bytes is not None or self.max_bytes is not None

    @property
    def is_flat(self) -> bool:
        """A fit with no bandwidth term (latency alone, as a piecewise link's first segment can be):
        the profiler stores its nil slope as a bus bandwidth of ~1e18 B/s, far above any link's."""
        return self.busbw_bytes_per_s >= FLAT_BUSBW_BYTES_PER_S

    def covers(self, nbytes: float) -> bool:
        return ((self.min_bytes is None or nbytes >= self.min_bytes)
                and (self.max_bytes is None or nbytes < self.max_bytes))


def link_key(link: LinkProfile) -> tuple[LinkLevel, Collective, int | None]:
    """What makes entries segments of one link: level, collective and group size."""
    return (link.level, link.collective, link.group_size)


def link_points(segments: list[LinkProfile]) -> list[TimedPoint]:
    """The measured points of a link's segments, each once, smallest message first (the profiler
    stores every point of the link on each segment; hand-written segments may hold only their own)."""
    seen = {(p.bytes, p.time_s): p for seg in segments for p in seg.points}
    return sorted(seen.values(), key=lambda p: (p.bytes, p.time_s))


def check_link_segments(links: list[LinkProfile]) -> None:
    """Segments of one link (same :func:`link_key`) must not overlap; raises ValueError naming them."""
    groups: dict[tuple, list[LinkProfile]] = {}
    for link in links:
        groups.setdefault(link_key(link), []).append(link)
    for (level, coll, n), segs in groups.items():
        if len(segs) < 2 or not any(s.segmented for s in segs):
            continue  # one entry, or unsegmented duplicates (older profiles): nothing to check
        lo = lambda s: -1 if s.min_bytes is None else s.min_bytes  # noqa: E731
        hi = lambda s: math.inf if s.max_bytes is None else s.max_bytes  # noqa: E731
        ordered = sorted(segs, key=lo)
        for a, b in zip(ordered, ordered[1:]):
            if lo(b) < hi(a):
                raise ValueError(
                    f"links: {level.value} {coll.value} (group_size={n}) has overlapping segments "
                    f"[{a.min_bytes}, {a.max_bytes}) and [{b.min_bytes}, {b.max_bytes}) (bytes; None = unbounded); "
                    "segments of one link must cover disjoint message-size ranges"
                )


class GemmLayout(str, Enum):
    """How the operands of ``C[m×n] = op(A)·op(B)`` (reducing over ``k``) lie in memory, for row-major
    (torch) tensors: ``n`` an operand as stored, ``t`` the transpose of a stored one. The three GEMMs
    of a linear layer each have their own, and a GEMM library's speed can depend on it (torch's CPU
    bf16 fallback, measured on an AVX2 VM: 256³-512³ ran 3-16x slower as ``nn`` than as ``nt`` or
    ``tn``). Column-major BLAS names each the other way round (cuBLAS and Transformer Engine call the
    forward ``X·Wᵀ`` "TN").

    - ``nt``: ``A[m×k]·B[n×k]ᵀ`` — forward ``Y = X·Wᵀ`` (m tokens, n out features, k in features)
    - ``nn``: ``A[m×k]·B[k×n]`` — input gradient ``dX = dY·W`` (m tokens, n in, k out)
    - ``tn``: ``A[k×m]ᵀ·B[k×n]`` — weight gradient ``dW = dYᵀ·X`` (m out, n in, k tokens)
    """

    nn = "nn"
    nt = "nt"
    tn = "tn"

    @property
    def role(self) -> str:
        """The linear-layer GEMM this layout is, e.g. ``forward X·Wᵀ (nt)``."""
        return ({"nt": "forward X·Wᵀ", "nn": "input grad dY·W", "tn": "weight grad dYᵀ·X"}[self.value]
                + f" ({self.value})")


# a linear layer's GEMMs in the order they run: forward, input gradient, weight gradient
LINEAR_LAYOUTS = (GemmLayout.nt, GemmLayout.nn, GemmLayout.tn)


class GemmPoint(Contract):
    precision: Precision
    m: int = Field(gt=0)
    n: int = Field(gt=0)
    k: int = Field(gt=0)
    layout: GemmLayout = Field(
        GemmLayout.nn, description="operand layout timed; points of profiles before this field load as nn (what "
        "they timed, except FP8 points, which ran as nt and are priced the same: FP8 has no other layout)")
    time_s: float = Field(gt=0, le=3600)


class AttentionPoint(Contract):
    precision: Precision
    batch: int = Field(gt=0)
    seq_length: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    causal: bool = True
    forward_time_s: float = Field(gt=0, le=3600)
    backward_time_s: float = Field(gt=0, le=3600)


class ElementwisePoint(Contract):
    op: str = Field(description="e.g. rmsnorm, layernorm, add, silu_mul, softmax_cross_entropy")
    precision: Precision
    bytes: int = Field(gt=0, le=2**50, description="bytes read + written")
    time_s: float = Field(gt=0, le=3600)


class AttentionBlocking(Contract):
    """One regime of an attention kernel's tiling: from this query length on (up to the next
    regime's), queries are processed in blocks of ``q_block`` rows against keys in blocks of
    ``kv_block`` columns, and a causal block computes every key block up to its last row's."""

    from_q_len: int = Field(ge=0, description="first query length of the regime")
    q_block: PositiveInt
    kv_block: PositiveInt


class ComputeProfile(Contract):
    gemm: list[GemmPoint] = Field(default_factory=list)
    attention: list[AttentionPoint] = Field(default_factory=list)
    elementwise: list[ElementwisePoint] = Field(default_factory=list)
    achieved_matmul_tflops: dict[Precision, PositiveFloat] = Field(default_factory=dict)
    achieved_memory_bandwidth_bytes_per_s: float | None = Field(None, gt=0)
    attention_blocking: list[AttentionBlocking] = Field(
        default_factory=list,
        description="how the measured attention kernel tiles a causal score matrix, by query length (torch's CPU "
        "flash kernel: query blocks of 32 rows below 192, 64 below 768, 256 from there, key blocks of 512); empty: "
        "not known (GPU kernels, whose tiles are small). The planner prices attention by the tiles computed and "
        "interpolates only between measurements in the same regime")

    @model_validator(mode="after")
    def _blocking(self) -> ComputeProfile:
        starts = [b.from_q_len for b in self.attention_blocking]
        if starts and starts[0] != 0:
            raise ValueError(f"attention_blocking from_q_len={starts} must start at 0, so every query length has "
                             f"a regime, e.g. {[0, *starts[1:]]}")
        if any(x >= y for x, y in zip(starts, starts[1:])):
            raise ValueError(f"attention_blocking from_q_len={starts} must be strictly ascending, one entry per "
                             f"regime, e.g. {sorted(set(starts))}")
        return self


class Assumptions(Contract):
    """How datasheet figures become achieved speed and usable memory where nothing was measured.

    Every number here is an assumption a prediction depends on, stated in the profile rather than
    hidden in code. Those marked *fitted* are calibrated by ``benchmarks/validate_published.py``
    against published runs; ``notes`` says where each of the others comes from.
    """

    matmul_efficiency: float = Field(
        0.75, gt=0, le=1, description="fraction of the dense 16-bit peak a large GEMM reaches (fitted)"
    )
    fp8_matmul_efficiency: float = Field(
        0.55, gt=0, le=1, description="fraction of the dense FP8 peak an FP8 GEMM reaches (fitted)"
    )
    attention_efficiency: float = Field(
        0.5, gt=0, le=1, description="fraction of the 16-bit peak fused (flash) attention reaches (fitted)"
    )
    memory_bandwidth_efficiency: float = Field(
        0.8, gt=0, le=1, description="fraction of HBM bandwidth reached by norms, elementwise ops and the optimizer"
    )
    gemm_tiles: list[tuple[PositiveInt, PositiveInt]] = Field(
        default_factory=lambda: [(128, 256), (256, 128), (128, 128)],
        description="output tiles the GEMM library picks from (wave quantisation over sm_count)",
    )
    gemm_k_overhead: float = Field(
        256.0,
        ge=0,
        description="per-tile prologue/epilogue in units of K: GEMM efficiency scales as K/(K + this) (fitted)",
    )
    kernel_overhead_s: float = Field(3e-6, ge=0, description="launch latency per kernel (CUDA launch, typical)")
    host_s_per_kernel: float | None = Field(
        None, ge=0, le=1e-2, description="GPU: the host's seconds per kernel the planner counts (Python, dispatcher, "
        "launch) where the target's runtime is bound by its host (planner.targets TargetFacts.host_s_per_kernel "
        "sets it; a run calibration's own figure wins); a pass waits for the slower of host and device. None: the "
        "host keeps ahead")
    async_overlap_efficiency: float = Field(
        0.85,
        ge=0,
        le=1,
        description="share of a collective hidden behind independent compute running beside it: DP/FSDP traffic, "
        "the backward TP all-reduce beside the weight-gradient GEMM (fitted)",
    )
    tp_overlap_efficiency: float = Field(
        0.6,
        ge=0,
        le=1,
        description="share of TP collectives hidden by decomposed GEMMs (async TP / TP-comm-overlap) (fitted)",
    )
    # -- MoE token dispatch (planner.cost.layer) ----------------------------------------------------------
    moe_host_sync_s: float = Field(
        26e-6, ge=0, description="GPU idle time of the device-to-host synchronisation a dropless MoE layer makes "
        "once per forward (and again in its recompute): the dispatcher needs the tokens-per-expert counts on the "
        "host to size the all-to-all and the grouped GEMM (Megatron-Core MoEAlltoAllTokenDispatcher."
        "_maybe_dtoh_and_synchronize, core_v0.15.0; the allgather dispatcher's .cpu(), DeepEP's and HybridEP's "
        "blocking dispatch likewise), none when padded to capacity (--moe-pad-expert-input-to-capacity). 26 us: "
        "a PyTorch device->host round trip measured on bare-metal Linux (github.com/jingyaogong/minimind/pull/837; "
        "45 us in github.com/kekzl/imp/pull/1357). The launch lead it costs is already priced: every kernel's "
        "kernel_overhead_s is charged as if never hidden")
    grouped_gemm_streams: int = Field(
        4, ge=1, description="GEMMs of a grouped expert GEMM that run at once: Transformer Engine's GroupedLinear "
        "(Megatron-Core TEGroupedMLP, --moe-grouped-gemm) issues one cuBLAS GEMM per local expert, round-robin on "
        "num_compute_streams = 4 streams (transformer_engine/common/util/multi_stream.cpp and gemm/cublaslt_gemm.cu "
        "multi_stream_cublas_gemm, v2.8 to v2.18; a CUTLASS grouped GEMM only with NVTE_USE_CUTLASS_GROUPED_GEMM=1 "
        "on Hopper); 1 for a loop over the experts on one stream. What each target runs replaces it "
        "(planner.targets.TargetFacts.expert_gemms, planner.targets.priced_profile): Megatron keeps this value")
    # -- ring latency of large groups (planner.cost.comm.ring_latency_s) ----------------------------------
    ring_step_intra_node_s: float = Field(
        1.9e-6, ge=0, description="latency of one step of a ring all-gather / reduce-scatter between two GPUs of a "
        "node: NCCL's tuning model, hwLat[NVLINK][RING][LL128] = 1.9 us (src/graph/tuning.cc, unchanged v2.10 to "
        "v2.30); LL128, the protocol NCCL's tuner picks for FSDP-sized messages (MBs to GBs) at hundreds of ranks, "
        "where the latency matters (Simple: 3.4 us)")
    ring_step_inter_node_s: float = Field(
        4.0e-6, ge=0, description="as ring_step_intra_node_s for a step that crosses nodes: "
        "hwLat[NET][RING][LL128] = 4.0 us (Simple: 9.6 us to v2.17, 14 us from v2.18)")
    # -- memory beside the tensors (planner.cost.memory.overhead_terms adds them up) -------------------
    runtime_bytes: int = Field(
        1_397_555_200, ge=0, description="device memory a rank uses outside the caching allocator: CUDA context, "
        "kernel images, cuBLAS/cuDNN handles (measured on an H100 80GB, torch 2.11 + CUDA 13.0, during training "
        "steps: benchmarks/memory_measure.py); on a CPU rank, the interpreter's and libraries' resident memory")
    communicator_bytes: int = Field(
        688_000_000, ge=0, description="device memory of one NCCL communicator after its first collective, one per "
        "process group of more than one rank (688 MB on 4x A100 NVLink for groups of 3-4 ranks, 544 MB for 2: "
        "github.com/NVIDIA/nccl/issues/964); 0 on CPU (gloo keeps host buffers)")
    all_to_all_communicator_bytes: int = Field(
        3_280_000_000, ge=0, description="further device memory NCCL connects for all-to-all within a node (one "
        "channel set per peer pair: 1.06 to 4.34 GB after the first all_to_all_single on 8x H100, "
        "github.com/NVIDIA/nccl/issues/1685); charged to expert-parallel groups")
    allocator_fragmentation: float = Field(
        0.04, ge=0, le=1, description="share of the allocator's peak it reserves beyond what is allocated, one "
        "stream (DDP, ZeRO-0/1): peak reserved / peak allocated - 1, median of the unsharded rows of "
        "benchmarks/memory_measure.py on an H100 (2.5-14%)")
    sharded_fragmentation: float = Field(
        0.22, ge=0, le=1, description="as allocator_fragmentation with FSDP/ZeRO-2/3, whose gathers and reductions "
        "run on their own streams and hold blocks the compute stream cannot reuse (19-41% measured, median 22%)")
    activation_memory_factor: float = Field(
        1.16, ge=0.5, le=4, description="measured / Korthikanti-formula activation bytes of the executor's blocks "
        "with 16-bit parameters (FSDP2 mixed precision): RoPE inputs, SiLU's input beside the SwiGLU product and "
        "fp32 norm statistics the formula leaves out (estimated from the H100 rows of benchmarks/memory_measure.py; "
        "benchmarks/memory_check.py prints its leave-one-model-out error)")
    autocast_activation_factor: float = Field(
        1.54, ge=0.5, le=4, description="as activation_memory_factor for fp32 parameters under torch.autocast "
        "(the executor's bf16 with ZeRO-0/1): the residual stream and norms stay fp32 and each linear input is "
        "saved after its bf16 cast (estimated from the same rows)")
    loss_bytes_per_logit: float = Field(
        14.0, ge=0, le=64, description="bytes per logit of one micro-batch held by the LM head and cross-entropy "
        "at its peak: 16-bit logits, their fp32 copy, the fp32 log-softmax and its gradient (14.0 measured by "
        "profiler/memory.py on an H100 for the executor's loss; Megatron's fused vocab-parallel loss holds about 6)")
    optimizer_temp_bytes_per_param: float = Field(
        4.0, ge=0, le=64, description="temporaries of one optimizer step per local parameter: torch's foreach "
        "AdamW materialises sqrt(v) for every parameter at once (4.0 measured on an H100)")
    memory_headroom: float = Field(
        0.05, ge=0, lt=1, description="share of device memory a plan keeps free beyond every predicted term: "
        "the margin for what the model does not count (other processes, allocator growth over a long run)")
    reserved_memory_bytes: int = Field(
        0, ge=0, description="any further fixed reserve per device beyond the named terms (profiles written "
        "before the terms were named kept 2 GiB here for all of them)"
    )
    cpu_optimizer_bytes_per_s: float = Field(
        40e9, gt=0, description="host memory bandwidth one GPU's share of CPU Adam gets (offload)"
    )
    notes: list[str] = Field(default_factory=list)


# a rank whose device check ran this far below the checks' median is a straggler, not timing noise:
# the profile notes it (SLOW DEVICES) and the planner prices every device at its pace (CPU ranks on a
# shared VM move more between checks)
SLOW_DEVICE_LIMIT = {"gpu": 0.10, "cpu": 0.25}


def slow_device_limit(cpu: bool) -> float:
    """How far below the device checks' median a straggler's check runs (:data:`SLOW_DEVICE_LIMIT`)."""
    return SLOW_DEVICE_LIMIT["cpu" if cpu else "gpu"]


def slow_checks(checks: list[DeviceCheck], value: Callable[[DeviceCheck], float],
                cpu: bool) -> tuple[float, list[DeviceCheck]]:
    """(median of ``value`` over ``checks``, the stragglers: checks more than :func:`slow_device_limit`
    below it, slowest first). The profile's SLOW DEVICES note and the planner's pace both read this."""
    median = statistics.median(value(c) for c in checks)
    limit = slow_device_limit(cpu)
    return median, sorted((c for c in checks if value(c) < (1 - limit) * median), key=lambda c: (value(c), c.rank))


class DeviceCheck(Contract):
    """One rank's device, checked at the same fixed GEMM and memory-bound add as every other rank's,
    so a slow or different device shows beside the compute tables (measured on rank 0 only)."""

    rank: int = Field(ge=0)
    host: str
    local_rank: int = Field(ge=0)
    device: str = Field(description="device name as the rank sees it")
    memory_bytes: int = Field(gt=0)
    precision: Precision = Field(description="of the GEMM check")
    gemm: tuple[PositiveInt, PositiveInt, PositiveInt] = Field(description="(m, n, k) of the GEMM check")
    gemm_tflops: float = Field(gt=0)
    memory_bandwidth_bytes_per_s: float = Field(gt=0, description="of an add over buffers several times the caches")


class CheckpointLine(Contract):
    """A checkpoint's time on one rank, every rank saving at once: ``t = fixed_s + per_tensor_s · tensors +
    bytes / bytes_per_s`` (:func:`planner.cost.goodput.line_time_s`), ``tensors`` the parameter tensors the rank
    saves (each with its optimizer states) and ``bytes`` the weights and optimizer states it writes (an
    asynchronous save's blocking: that it copies)."""

    fixed_s: float = Field(ge=0, le=3600, description="per save: planning, metadata, the save's collectives")
    per_tensor_s: float = Field(ge=0, le=10, description="per parameter tensor saved: its state-dict entries "
                                "(weight, optimizer states), their write requests and files")
    bytes_per_s: float = Field(gt=0, le=1e13, description="bulk rate of one rank while every rank saves")


class CheckpointPoint(Contract):
    """One measured save configuration (the median of its trials)."""

    mode: Literal["sync", "async"]
    bytes: int = Field(ge=0, le=2**50, description="weights and optimizer states per rank")
    tensors: int = Field(ge=1, le=10**7, strict=True, description="parameter tensors per rank")
    blocking_s: float = Field(gt=0, le=86400, description="training stops this long (async: until the save "
                              "returned)")
    write_s: float = Field(gt=0, le=86400, description="from the save's start until it was on storage")
    held_bytes: int | None = Field(None, ge=0, le=2**50, description="what the rank held (an async save copies "
                                   "it all); None: bytes (the profiler's ranks hold what they write)")
    run: str | None = Field(None, max_length=200, description="the run it was measured in (autopar calibrate); "
                            "None: the profiler")


class CheckpointCost(Contract):
    """What a checkpoint costs on this cluster's storage, measured by ``autopar profile`` saving model-shaped
    states with the executor's own checkpointer (torch.distributed.checkpoint) on every rank at once: a line
    per mode fitted to the points (``planner.cost.goodput.fit_line``)."""

    ranks: int = Field(ge=1, le=MAX_GPUS, strict=True, description="ranks that saved at once")
    storage: str = Field(max_length=500, description="where the saves were written")
    sync: CheckpointLine = Field(description="dcp.save: training stops for all of it")
    async_blocking: CheckpointLine = Field(description="dcp.async_save until it returns (the copy to host)")
    async_write: CheckpointLine = Field(description="dcp.async_save until the write is done (behind training)")
    points: list[CheckpointPoint] = Field(default_factory=list, max_length=1000)


FACTOR_BOUNDS = (0.05, 50.0)  # a calibration factor outside these is clipped: a term off by more is not tuned away


class TermFactor(Contract):
    """How much longer a term of the step measured than predicted on this cluster's runs
    (``planner.run_calibration``)."""

    factor: float = Field(ge=FACTOR_BOUNDS[0], le=FACTOR_BOUNDS[1], description="measured / predicted, the median "
                          "over the runs, clipped to FACTOR_BOUNDS")
    low: float = Field(gt=0, description="the least run's ratio (clipped): with high, the runs' spread (the factor, "
                       "shrunk toward the whole step's ratio, may lie outside it)")
    high: float = Field(gt=0)
    runs: int = Field(ge=1, strict=True, description="runs that measured and predicted this term")


class RunCalibration(Contract):
    """Corrections of the cost model's terms fitted on this cluster's own runs: each term of the step
    (``STEP_TERMS``) predicted by the profile it was fitted on is multiplied by its factor."""

    factors: dict[str, TermFactor]
    runs: list[str] = Field(description="the runs fitted on (the service's ids, or report files)")
    fitted_median_error: float = Field(ge=0, description="median |predicted / measured - 1| of the step over the "
                                       "runs fitted on, calibrated (in sample)")
    held_out_median_error: float | None = Field(None, ge=0, description="the same, each run predicted by factors "
                                                "fitted without it (leave-one-run-out); None with one run")
    uncalibrated_median_error: float = Field(ge=0, description="the runs' median error before calibration")
    left_out: list[str] = Field(default_factory=list, description="runs not fitted on, each with why")
    host_s_per_kernel: float | None = Field(
        None, ge=0, le=1e-2, description="GPU runs: the host's time per kernel it launches (Python, dispatcher, "
        "launch), fitted on the runs whose device sat idle; a pass whose kernels take the host longer than the "
        "device runs them waits for the host (planner.cost.layer.PassCost.calibrated). None: not fitted (CPU "
        "runs, where host and device are one, or no run was host-bound)")
    held_out_residuals: list[float] = Field(
        default_factory=list, description="each run's ln(predicted / measured step) by factors fitted without it "
        "(leave-one-run-out): the interval of predictions on this profile (planner.uncertainty.assess)")
    memory_offset_bytes: int | None = Field(
        None, ge=-(2**40), le=2**40, strict=True, description="the runs' median measured peak memory per rank "
        "less the predicted one (as measured: allocated on a GPU, RSS on a CPU), added to every prediction's peak "
        "(memory term 'calibration'); None: not fitted")

    @field_validator("factors")
    @classmethod
    def _known_terms(cls, v: dict[str, TermFactor]) -> dict[str, TermFactor]:
        unknown_terms(v)
        return v

    def factor(self, term: str) -> float:
        got = self.factors.get(term)
        return 1.0 if got is None else got.factor


class ClusterProfile(Contract):
    schema_version: Literal["1"] = SCHEMA_VERSION
    kind: Literal["measured", "reference"]
    name: ClusterName
    created_at: PlausibleDate = Field(default_factory=lambda: datetime.now(UTC))
    device: DeviceSpec
    gpus_per_node: int = Field(gt=0, le=MAX_GPUS_PER_NODE, strict=True, description="devices (or CPU ranks) per node")
    num_nodes: int = Field(gt=0, le=MAX_GPUS, strict=True)
    environment: Environment = Field(default_factory=Environment)
    compute: ComputeProfile = Field(default_factory=ComputeProfile)
    links: list[LinkProfile] = Field(default_factory=list)
    assumptions: Assumptions = Field(default_factory=Assumptions)
    sources: list[str] = Field(default_factory=list)
    device_checks: list[DeviceCheck] = Field(
        default_factory=list, description="every rank's device at one GEMM and one memory-bound add (measured "
        "profiles): the compute tables are rank 0's, and synchronous training runs at its slowest device's pace, "
        "so the planner scales them by rank 0's check over the slowest rank's")
    calibration: RunCalibration | None = Field(None, description="corrections fitted on this cluster's runs "
                                               "(`autopar calibrate`); every prediction on the profile applies them")
    checkpoint: CheckpointCost | None = Field(
        None, description="a checkpoint's cost on this cluster's storage, measured (autopar profile); None: "
        "the goodput prices the copy by the host link and the write by the goal's storage bandwidth alone")

    def term_factor(self, term: str) -> float:
        """The calibration's factor of ``term`` (``planner.contracts.report.STEP_TERMS``); 1 uncalibrated."""
        return 1.0 if self.calibration is None else self.calibration.factor(term)

    @property
    def is_cpu(self) -> bool:
        """A profile of CPU ranks (``autopar profile`` names their device ``CPU: ...``)."""
        return self.device.name.upper().startswith("CPU")

    @model_validator(mode="after")
    def _checks(self) -> ClusterProfile:
        ranks = [c.rank for c in self.device_checks]
        if ranks and (0 not in ranks or len(set(ranks)) != len(ranks)):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            problems = (([f"repeats rank(s) {dup[:16]}"] if dup else [])
                        + ([] if 0 in ranks else ["has no check of rank 0"]))
            raise ValueError(
                f"device_checks {' and '.join(problems)} (ranks {sorted(ranks)[:16]}); give one check per "
                "rank, rank 0's included (the compute tables are rank 0's and are scaled by its check)"
            )
        between = [link for link in self.links if link.level is not LinkLevel.host_device]
        if self.kind == "measured" and self.num_gpus > 1 and not between:
            raise ValueError(
                f"links: a measured profile of {self.num_gpus} ranks has no links between them (only "
                f"{len(self.links)} host-device ones); upload what `autopar profile` measured on all of them, "
                "or a profile of one rank")
        return self

    @model_validator(mode="after")
    def _size(self) -> ClusterProfile:
        if self.num_gpus > MAX_GPUS:
            raise ValueError(
                f"num_nodes={self.num_nodes} x gpus_per_node={self.gpus_per_node} is {self.num_gpus:,} devices, more "
                f"than {MAX_GPUS:,} (no cluster has as many); use at most {MAX_GPUS // self.gpus_per_node:,} nodes"
            )
        return self

    @model_validator(mode="after")
    def _links(self) -> ClusterProfile:
        if self.num_nodes > 1 and not any(link.level is LinkLevel.inter_node for link in self.links):
            raise ValueError(
                f"num_nodes={self.num_nodes} but links has no inter_node entry; "
                "add the network's bandwidth or describe a single node"
            )
        check_link_segments(self.links)
        return self

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def with_nodes(self, num_nodes: int) -> ClusterProfile:
        """The same machines, ``num_nodes`` of them (reference profiles describe any node count); validated."""
        return ClusterProfile.model_validate({**self.model_dump(), "num_nodes": num_nodes})
