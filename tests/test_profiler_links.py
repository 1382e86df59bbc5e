"""Link fitting: α-β recovery from synthetic points, the busbw convention the planner uses, group plans."""

from __future__ import annotations

import random

import pytest

from planner.contracts import ClusterProfile, Collective, LinkLevel
from planner.contracts.cluster import DeviceSpec, LinkProfile, TimedPoint
from planner.cost.comm import GroupPlacement, collective_time_s
from profiler.links import (
    busbw_from_slope, fit_alpha_beta, fit_link, link_fit_report, message_sizes, plan_groups,
)

SIZES = message_sizes(4096, 256 << 20)


def _points(alpha: float, slope: float, noise: float = 0.0, seed: int = 0) -> list[TimedPoint]:
    rng = random.Random(seed)
    return [TimedPoint(bytes=b, time_s=(alpha + slope * b) * (1 + rng.uniform(-noise, noise))) for b in SIZES]


def test_sizes_cover_4k_to_256m():
    assert SIZES[0] == 4096 and SIZES[-1] == 256 << 20 and len(SIZES) == 17
    quick = message_sizes(4096, 16 << 20, quick=True)
    assert quick == [4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20]


def test_fit_recovers_alpha_and_bandwidth_exactly():
    fit = fit_alpha_beta(_points(25e-6, 1 / 50e9))
    assert fit.alpha_s == pytest.approx(25e-6, rel=1e-9)
    assert 1 / fit.slope_s_per_byte == pytest.approx(50e9, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.worst_rel_err < 1e-9


def test_fit_with_noise_reports_r2_and_keeps_small_messages():
    fit = fit_alpha_beta(_points(25e-6, 1 / 50e9, noise=0.05, seed=3))
    assert fit.alpha_s == pytest.approx(25e-6, rel=0.1)  # relative weighting: latency is not swamped by 256 MiB
    assert 1 / fit.slope_s_per_byte == pytest.approx(50e9, rel=0.1)
    assert 0.99 < fit.r2 < 1.0
    assert fit.worst_rel_err < 0.15


def test_fit_clamps_negative_alpha_and_flat_data():
    pts = [TimedPoint(bytes=b, time_s=b / 1e9 - 1e-7 if b > 8192 else b / 1e9) for b in SIZES]
    fit = fit_alpha_beta(pts)
    assert fit.alpha_s >= 0
    flat = fit_alpha_beta([TimedPoint(bytes=b, time_s=1e-3) for b in SIZES])
    assert flat.alpha_s == pytest.approx(1e-3) and flat.slope_s_per_byte == 0


def _profile(links: list[LinkProfile], nodes: int = 2, per_node: int = 2) -> ClusterProfile:
    dev = DeviceSpec(name="x", memory_bytes=1 << 34, peak_tflops={"bf16": 1.0}, hbm_bandwidth_bytes_per_s=1e11)
    return ClusterProfile(kind="measured", name="t", device=dev, gpus_per_node=per_node, num_nodes=nodes, links=links)


@pytest.mark.parametrize("collective", [c for c in Collective if c not in (Collective.host_to_device, Collective.device_to_host)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_fitted_busbw_means_what_collective_time_s_assumes(collective, n):
    """Points made as alpha + slope·bytes come back from the planner's own formula, per level."""
    alpha, slope = 30e-6, 1 / 20e9
    pts = _points(alpha, slope)
    size = 2 if collective is Collective.p2p else n
    intra = fit_link(LinkLevel.intra_node, collective, size, size, pts, "t")
    prof = _profile([intra], nodes=1, per_node=8)
    for p in pts:
        assert collective_time_s(prof, collective, GroupPlacement(size, size), p.bytes) == pytest.approx(p.time_s, rel=1e-9)
    # across nodes, one rank per node
    inter = fit_link(LinkLevel.inter_node, collective, size, 1, pts, "t")
    prof = _profile([inter], nodes=size, per_node=1)
    for p in pts:
        assert collective_time_s(prof, collective, GroupPlacement(size, 1), p.bytes) == pytest.approx(p.time_s, rel=1e-9)


@pytest.mark.parametrize("collective", [Collective.all_reduce, Collective.all_gather, Collective.reduce_scatter,
                                        Collective.all_to_all])
def test_all_ranks_group_across_nodes_is_stored_per_rank(collective):
    """4 ranks on 2 nodes (2 per node): the planner multiplies the per-rank network busbw by 2
    (ring) or prices only the off-node share (all-to-all); the fit divides accordingly."""
    pts = _points(50e-6, 1 / 5e9)
    link = fit_link(LinkLevel.inter_node, collective, 4, 2, pts, "t")
    fast_intra = LinkProfile(level=LinkLevel.intra_node, collective=collective, group_size=2, alpha_s=0,
                             busbw_bytes_per_s=1e15)
    prof = _profile([link, fast_intra])
    for p in pts:
        assert collective_time_s(prof, collective, GroupPlacement(4, 2), p.bytes) == pytest.approx(p.time_s, rel=1e-9)
    rows = link_fit_report(prof)
    row = next(r for r in rows if r["level"] == "inter_node")
    assert row["r2"] == pytest.approx(1.0) and row["worst_rel_err"] < 1e-9


def test_busbw_conventions():
    s = 1 / 10e9
    assert busbw_from_slope(Collective.all_reduce, s, 4, 4, LinkLevel.intra_node) == pytest.approx(1.5 * 10e9)
    assert busbw_from_slope(Collective.all_gather, s, 4, 4, LinkLevel.intra_node) == pytest.approx(0.75 * 10e9)
    assert busbw_from_slope(Collective.p2p, s, 2, 1, LinkLevel.inter_node) == pytest.approx(10e9)


def test_link_fit_report_prints(capsys):
    pts = _points(10e-6, 1 / 1e9, noise=0.1, seed=1)
    prof = _profile([fit_link(LinkLevel.intra_node, Collective.all_reduce, 2, 2, pts, "t")], nodes=1)
    rows = link_fit_report(prof, print_table=True)
    assert rows[0]["collective"] == "all_reduce" and 0.9 < rows[0]["r2"] <= 1 and rows[0]["worst_rel_err"] < 0.25
    assert "all_reduce" in capsys.readouterr().out


def test_group_plan_4_ranks_2_per_node():
    specs = plan_groups(4, 2, emulated=True)
    got = [(s.level, s.size, s.per_node, s.ranks) for s in specs]
    assert got == [(LinkLevel.intra_node, 2, 2, [[0, 1], [2, 3]]), (LinkLevel.inter_node, 2, 1, [[0, 2], [1, 3]]),
                   (LinkLevel.inter_node, 4, 2, [[0, 1, 2, 3]])]
    assert all("emulated" in s.label for s in specs)
    assert [s.size for s in plan_groups(8, 4) if s.level is LinkLevel.intra_node] == [2, 4]
    p2p = [s for s in plan_groups(16, 4) if Collective.p2p in s.collectives]
    assert {(s.level, s.size) for s in p2p} == {(LinkLevel.intra_node, 2), (LinkLevel.inter_node, 2)}
