"""Communication: where each process group lives on the machine, and α-β collective times.

Mesh order, outermost first: ``pp, dp_replicate, dp_shard, cp, tp`` (TP innermost, so it stays
inside a node). The routed experts are folded over the same ``dp_shard × cp × tp`` block of ranks,
refactored as ``(edp, ep, etp)`` with etp innermost (MoE parallel folding; Megatron-Core's expert
RankGenerator): the ETP group is etp consecutive ranks, the EP group has stride etp and the expert
data-parallel group (``ParallelLayout.expert_dp``) stride ep·etp; with etp = tp that is EP over the
``dp_shard × cp`` ranks at stride tp. A group whose ranks are ``stride`` apart has
``min(n, gpus_per_node // stride)`` members on each node.

Latency at scale: NCCL runs all-gather and reduce-scatter as a ring (its tree is for all-reduce only;
PAT, NCCL >= 2.23, only with one rank per node), n - 1 steps in a row, each paying a step latency
(:func:`ring_latency_s`). A link's ``alpha_s`` is its latency at the group it was measured on; a larger
group pays the steps it has beyond that group (:func:`extra_ring_latency_s`): at 512 ranks on 64 nodes
about 1 ms per call, more than the bytes of a 1B model's layer take.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from planner.contracts import Assumptions, ClusterProfile, Collective, LinkLevel, LinkProfile, ParallelLayout
from planner.cost.memo import memo_for
from planner.errors import AutoparError


@dataclass(frozen=True)
class GroupPlacement:
    """A process group of ``size`` ranks with ``per_node`` of them on each node it spans."""

    size: int
    per_node: int

    @property
    def level(self) -> LinkLevel:
        return LinkLevel.intra_node if self.per_node >= self.size else LinkLevel.inter_node


@functools.lru_cache(maxsize=4096)
def placement(size: int, stride: int, gpus_per_node: int) -> GroupPlacement:
    """Members per node of a group of ``size`` ranks spaced ``stride`` apart in the rank order."""
    if size <= 1:
        return GroupPlacement(1, 1)
    per_node = 1 if stride >= gpus_per_node else max(1, min(size, gpus_per_node // stride))
    return GroupPlacement(size, per_node)


def mesh_groups(layout: ParallelLayout, gpus_per_node: int) -> dict[str, GroupPlacement]:
    """Placement of every parallel dimension's group under the layout's mesh order
    (:attr:`~planner.contracts.ParallelLayout.MESH_ORDER`; experts: ``etp``, ``ep`` and ``expert_dp`` as
    folded over the ``dp_shard × cp × tp`` ranks, :attr:`~planner.contracts.ParallelLayout.EXPERT_MESH_ORDER`)."""
    stride = layout.mesh_strides().__getitem__
    return {
        "tp": placement(layout.tp, stride("tp"), gpus_per_node),
        "cp": placement(layout.cp, stride("cp"), gpus_per_node),
        "ep": placement(layout.ep, stride("ep"), gpus_per_node),
        "etp": placement(layout.expert_tp, stride("etp"), gpus_per_node),
        "expert_dp": placement(layout.expert_dp, stride("edp"), gpus_per_node),
        "dp_shard": placement(layout.dp_shard, stride("dp_shard"), gpus_per_node),
        "dp_replicate": placement(layout.dp_replicate, stride("dp_replicate"), gpus_per_node),
        "dp": placement(layout.dp, stride("dp_shard"), gpus_per_node),
        "pp": placement(layout.pp, stride("pp"), gpus_per_node),
    }


def ring_factor(collective: Collective, n: int) -> float:
    """Bytes each rank moves per byte of the (full) buffer, in units that match bus bandwidth.

    all-reduce ``2(n-1)/n``; all-gather, reduce-scatter, all-to-all ``(n-1)/n``; p2p and copies 1.
    """
    if collective is Collective.all_reduce:
        return 2.0 * (n - 1) / n
    if collective in (Collective.all_gather, Collective.reduce_scatter, Collective.all_to_all):
        return (n - 1) / n
    return 1.0


def find_link(profile: ClusterProfile, level: LinkLevel, collective: Collective, group_size: int,
              nbytes: float | None = None) -> LinkProfile:
    """The profile's entry for this collective and level (nearest measured group size).

    A level without an entry for this collective falls back to its all-reduce entry, then to any entry.
    A piecewise link (entries with ``min_bytes``/``max_bytes``) gives the segment covering ``nbytes``,
    else the nearest one; ``nbytes=None`` asks for the large-message segment (bulk transfers).
    """
    memo = memo_for(profile)
    if memo is None:
        segments = _find_segments(profile, level, collective, group_size)
    else:
        key = ("link", level, collective, group_size)
        segments = memo.get(key)
        if segments is None:
            segments = memo[key] = _find_segments(profile, level, collective, group_size)
    return segments[0] if len(segments) == 1 else pick_segment(segments, nbytes)


def pick_segment(segments: list[LinkProfile], nbytes: float | None) -> LinkProfile:
    """The segment whose ``[min_bytes, max_bytes)`` covers ``nbytes``; outside them all, the nearest
    (by size ratio); ``None`` = the segment of the largest messages."""
    if len(segments) == 1:
        return segments[0]
    if nbytes is None:
        return max(segments, key=lambda s: (s.max_bytes is None, s.max_bytes or 0, s.min_bytes or 0))
    for seg in segments:
        if seg.covers(nbytes):
            return seg
    x = max(float(nbytes), 1.0)

    def distance(seg: LinkProfile) -> float:
        if seg.min_bytes is not None and x < seg.min_bytes:
            return math.log(seg.min_bytes / x)
        if seg.max_bytes is not None and x >= seg.max_bytes:
            return math.log(x / seg.max_bytes)
        return 0.0

    return min(segments, key=distance)


def link_segments(links: list[LinkProfile], level: LinkLevel, collective: Collective,
                  group_size: int | None) -> list[LinkProfile]:
    """Every entry of one link (its segments, smallest messages first)."""
    segs = [x for x in links if x.level is level and x.collective is collective and x.group_size == group_size]
    return sorted(segs, key=lambda s: -1 if s.min_bytes is None else s.min_bytes)


def _find_segments(profile: ClusterProfile, level: LinkLevel, collective: Collective,
                   group_size: int) -> list[LinkProfile]:
    on_level = [link for link in profile.links if link.level is level]
    if not on_level:
        raise AutoparError(
            "profile.links", f"no {level.value} entry",
            f"measure the {level.value} links or use a profile that has them",
            problem=f"in cluster profile '{profile.name}' cannot place a {collective.value} of {group_size} ranks",
        )
    for wanted in (collective, Collective.all_reduce):
        same = [link for link in on_level if link.collective is wanted]
        if same:
            best = min(same, key=lambda link: abs((link.group_size or group_size) - group_size))
            return _segments_of(same, best)
    first = on_level[0]
    return _segments_of([x for x in on_level if x.collective is first.collective], first)


def _segments_of(candidates: list[LinkProfile], chosen: LinkProfile) -> list[LinkProfile]:
    """``chosen`` and the other segments of its link; unsegmented duplicates keep the old first-match."""
    if not chosen.segmented:
        return [chosen]
    segs = [x for x in candidates if x.group_size == chosen.group_size and x.segmented]
    return sorted(segs, key=lambda s: -1 if s.min_bytes is None else s.min_bytes)


RING_COLLECTIVES = (Collective.all_gather, Collective.reduce_scatter)
"""Collectives NCCL runs only as a ring on groups spanning nodes with several ranks per node (its tuning
model, src/graph/tuning.cc: all-gather and reduce-scatter have no tree; PAT, added in 2.23.4 with
"logarithmic number of network steps for small sizes at scale", "only supports one rank per node",
release notes of v2.23.4-1). All-reduce switches to a tree at scale (latency logarithmic in the nodes):
its ``alpha_s`` stands."""


def ring_latency_s(assumptions: Assumptions, size: int, per_node: int) -> float:
    """Step latencies of one ring all-gather / reduce-scatter over ``size`` ranks, ``per_node`` of them
    on each node: ``size - 1`` steps, ``nodes - 1`` of them crossing nodes (NCCL's tuning model:
    ``(nsteps - nInterSteps)·intraLat + nInterSteps·interLat``, nsteps = n - 1, nInterSteps = nodes - 1)."""
    if size <= 1:
        return 0.0
    inter = -(-size // max(per_node, 1)) - 1
    return (size - 1 - inter) * assumptions.ring_step_intra_node_s + inter * assumptions.ring_step_inter_node_s


def measured_group(link: LinkProfile, gpus_per_node: int) -> GroupPlacement:
    """The group a link's ``alpha_s`` was measured on: its ``group_size`` and ``ranks_per_node``; for
    an entry of any size (reference profiles' "typical NCCL small-message times", nccl-tests on whole
    nodes) one node's GPUs within a node, two nodes' across."""
    per = link.ranks_per_node
    if link.group_size:
        n = link.group_size
        if per is None:
            per = min(n, gpus_per_node) if link.level is LinkLevel.intra_node else max(1, min(gpus_per_node, n // 2))
        return GroupPlacement(n, per)
    n = gpus_per_node if link.level is LinkLevel.intra_node else 2 * gpus_per_node
    return GroupPlacement(n, gpus_per_node)


def extra_ring_latency_s(profile: ClusterProfile, collective: Collective, group: GroupPlacement,
                         link: LinkProfile) -> float:
    """Latency a ring all-gather / reduce-scatter over ``group`` pays beyond ``link.alpha_s``: the step
    latencies of its ring less those of the group the link was measured on, never below 0 (a smaller
    group keeps the measured latency). 0 for other collectives (:data:`RING_COLLECTIVES`)."""
    if collective not in RING_COLLECTIVES or group.size <= 1:
        return 0.0
    base = measured_group(link, profile.gpus_per_node)
    a = profile.assumptions
    return max(0.0, ring_latency_s(a, group.size, group.per_node) - ring_latency_s(a, base.size, base.per_node))


def collective_time_s(
    profile: ClusterProfile, collective: Collective, group: GroupPlacement, nbytes: float
) -> float:
    """α-β time of one collective on ``nbytes`` (the full buffer: all-gather output, all-reduce input).

    ``t = alpha + ring_factor · bytes / busbw``, all-gather and reduce-scatter adding the ring steps a
    group larger than the link's measured one pays (:func:`extra_ring_latency_s`). A group spanning
    nodes with g members per node runs g rails in parallel:
    ``busbw = min(intra-node busbw, g · per-GPU network busbw)``. All-to-all
    has no such sharing: each rank pushes its own ``(n - g)/n`` of the buffer through its own NIC,
    ``t = alpha + max(bytes·(n-g)/n / nic, bytes·(g-1)/n / nvlink)``.

    An inter-node entry measured at exactly this group's size and placement (``group_size`` n,
    ``ranks_per_node`` g) already holds the on-node legs, so it is not bounded by the intra-node
    link a second time: ``g · busbw`` (ring) and ``bytes·(n-g)/n / nic`` (all-to-all) alone.
    """
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    if collective is Collective.p2p:
        link = find_link(profile, group.level, collective, 2, nbytes)
        return link.alpha_s + nbytes / link.busbw_bytes_per_s
    factor = ring_factor(collective, n)
    if group.level is LinkLevel.intra_node:
        link = find_link(profile, LinkLevel.intra_node, collective, n, nbytes)
        latency = link.alpha_s + extra_ring_latency_s(profile, collective, group, link)
        return latency + factor * nbytes / link.busbw_bytes_per_s
    net = find_link(profile, LinkLevel.inter_node, collective, n, nbytes)
    as_measured = net.collective is collective and net.group_size == n and net.ranks_per_node == group.per_node
    if collective is Collective.all_to_all:
        # every rank sends (n - g)/n of its buffer through its own NIC and (g - 1)/n over NVLink
        g = group.per_node
        off_node = nbytes * (n - g) / n / net.busbw_bytes_per_s
        on_node = 0.0
        if g > 1 and not as_measured:
            intra = find_link(profile, LinkLevel.intra_node, collective, g, nbytes)
            on_node = nbytes * (g - 1) / n / intra.busbw_bytes_per_s
        return net.alpha_s + max(off_node, on_node)
    busbw = net.busbw_bytes_per_s * group.per_node
    if group.per_node > 1 and not as_measured:
        intra = find_link(profile, LinkLevel.intra_node, collective, group.per_node, nbytes)
        busbw = min(busbw, intra.busbw_bytes_per_s)
    return net.alpha_s + extra_ring_latency_s(profile, collective, group, net) + factor * nbytes / busbw


def call_latency_s(profile: ClusterProfile, collective: Collective, group: GroupPlacement, nbytes: float) -> float:
    """The latency part of :func:`collective_time_s` (``alpha`` plus the ring's extra steps) on the link
    segment covering ``nbytes``: what each further call pays when the same bytes go in several calls."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    size = 2 if collective is Collective.p2p else group.size
    link = find_link(profile, group.level, collective, size, nbytes)
    return link.alpha_s + extra_ring_latency_s(profile, collective, group, link)


def host_copy_time_s(profile: ClusterProfile, nbytes: float, to_device: bool) -> float:
    """Host↔device copy over the host link (PCIe), pinned memory."""
    if nbytes <= 0:
        return 0.0
    wanted = Collective.host_to_device if to_device else Collective.device_to_host
    link = find_link(profile, LinkLevel.host_device, wanted, 1, nbytes)
    return link.alpha_s + nbytes / link.busbw_bytes_per_s


def hidden_time_s(comm_s: float, window_s: float, overlap_efficiency: float) -> float:
    """Part of ``comm_s`` hidden behind ``window_s`` of independent compute: ``eff · min(comm, window)``."""
    return overlap_efficiency * min(comm_s, max(window_s, 0.0))
