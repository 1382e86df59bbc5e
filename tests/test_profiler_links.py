"""Link fitting: α-β recovery from synthetic points, the busbw convention the planner uses, group plans."""

from __future__ import annotations

import random

import pytest

from planner.contracts import ClusterProfile, Collective, LinkLevel
from planner.contracts.cluster import DeviceSpec, LinkProfile, TimedPoint
from planner.cost.comm import GroupPlacement, collective_time_s, find_link
from profiler.fit import (
    busbw_from_slope,
    fit_alpha_beta,
    fit_link,
    fit_link_segments,
    fit_segments,
    link_fit_report,
    minimax_rel_err,
)
from profiler.identity import last_level_cache_bytes, reachable_cache_bytes
from profiler.links import (
    MIB,
    ColdCopies,
    cold_arena_bytes,
    host_waves,
    measure_host_device,
    message_sizes,
    oversubscribed,
    plan_groups,
    remeasure_candidates,
    remeasured_fastest,
    reps_for,
    reps_within,
    timed_groups,
    trials_for,
)

SIZES = message_sizes(4096, 256 << 20)


def _points(alpha: float, slope: float, noise: float = 0.0, seed: int = 0) -> list[TimedPoint]:
    rng = random.Random(seed)
    return [TimedPoint(bytes=b, time_s=(alpha + slope * b) * (1 + rng.uniform(-noise, noise))) for b in SIZES]


def test_sizes_cover_4k_to_256m():
    assert SIZES[0] == 4096 and SIZES[-1] == 256 << 20 and len(SIZES) == 17
    quick = message_sizes(4096, 16 << 20, quick=True)  # 4x apart below 1 MiB, 2x from there
    assert quick == [4096, 16384, 65536, 262144, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]


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


def test_fit_is_minimax_on_relative_error():
    """Per-byte time rising 1.0 -> 1.5 (leaving a cache): with alpha >= 0 the best line is through
    the origin at the harmonic-mean-like slope 2·1·1.5/(1+1.5) = 1.2, missing both points by 20%
    (least squares on relative error would give 1.154 and miss the larger one by 23%)."""
    pts = [TimedPoint(bytes=4096, time_s=4096e-9), TimedPoint(bytes=8192, time_s=8192 * 1.5e-9)]
    fit = fit_alpha_beta(pts)
    assert fit.alpha_s == pytest.approx(0, abs=1e-12)
    assert fit.slope_s_per_byte == pytest.approx(1.2e-9, rel=1e-6)
    assert fit.worst_rel_err == pytest.approx(0.2, rel=1e-6) == minimax_rel_err(pts)


def test_minimax_fit_equioscillates_and_breaks_ties_by_total_error():
    # latency 10 us, 1 GB/s, with the middle point 30% high: the minimax line splits that error
    # (over the middle, under its neighbours by the same relative amount)
    sizes = [4096 * 4**i for i in range(5)]
    pts = [TimedPoint(bytes=b, time_s=(10e-6 + b / 1e9) * (1.3 if i == 2 else 1.0)) for i, b in enumerate(sizes)]
    fit = fit_alpha_beta(pts)
    errs = [(fit.alpha_s + fit.slope_s_per_byte * p.bytes - p.time_s) / p.time_s for p in pts]
    worst = max(abs(e) for e in errs)
    assert worst == pytest.approx(fit.worst_rel_err) and worst == pytest.approx(0.3 / 2.3, rel=1e-6)
    assert min(errs) == pytest.approx(-worst, rel=1e-6) and max(errs) == pytest.approx(worst, rel=1e-6)
    # flat points: every line between them is minimax for two points; the total-error tie-break
    # keeps the level line
    flat = fit_alpha_beta([TimedPoint(bytes=b, time_s=1e-3) for b in sizes])
    assert flat.alpha_s == pytest.approx(1e-3) and flat.slope_s_per_byte == pytest.approx(0, abs=1e-18)


def test_remeasure_candidates_flags_inflated_and_non_monotone_points():
    sizes = [4096 * 4**i for i in range(7)]
    clean = [20e-6 + b / 1e9 for b in sizes]
    assert remeasure_candidates(sizes, clean) == []
    spoiled = list(clean)
    spoiled[3] *= 1.6  # preempted: 60% slow
    assert remeasure_candidates(sizes, spoiled) == [3]
    dip = list(clean)
    dip[1] = dip[2] * 1.05  # a 16 KiB message slower than the 64 KiB one (within 10% of a fit or not)
    assert 1 in remeasure_candidates(sizes, dip)


def test_remeasured_fastest_retimes_suspects_after_every_first_pass():
    """A synthetic timer: size 2 of series 0 is spoiled (2x) in the first pass only; the re-measure
    finds it, keeps the fastest trial, and runs only after both series' first passes."""
    sizes = [4096 * 4**i for i in range(6)]
    true = [30e-6 + b / 2e9 for b in sizes]
    calls: list[tuple[int, int, tuple[int, ...]]] = []

    def timer(series: int, indices: list[int], round_: int) -> list[float]:
        calls.append((series, round_, tuple(indices)))
        return [true[i] * (2.0 if (series, i, round_) == (0, 2, 0) else 1.0) for i in indices]

    times, extra = remeasured_fastest(2, sizes, timer)
    assert times[0] == pytest.approx(true) and times[1] == pytest.approx(true)
    assert extra == [[0, 0, 1, 0, 0, 0], [0] * 6]
    assert [c[:2] for c in calls] == [(0, 0), (1, 0), (0, 1)] and calls[2][2] == (2,)
    # the reduce step sees every pass (here: a max over two "ranks", the other one 10% slower)
    times, _ = remeasured_fastest(1, sizes, timer, reduce=lambda s, ts: [t * 1.1 for t in ts])
    assert times[0] == pytest.approx([t * 1.1 for t in true])


def _profile(links: list[LinkProfile], nodes: int = 2, per_node: int = 2) -> ClusterProfile:
    dev = DeviceSpec(name="x", memory_bytes=1 << 34, peak_tflops={"bf16": 1.0}, hbm_bandwidth_bytes_per_s=1e11)
    return ClusterProfile(kind="measured", name="t", device=dev, gpus_per_node=per_node, num_nodes=nodes, links=links)


@pytest.mark.parametrize("collective", [c for c in Collective
                                        if c not in (Collective.host_to_device, Collective.device_to_host)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_fitted_busbw_means_what_collective_time_s_assumes(collective, n):
    """Points made as alpha + slope·bytes come back from the planner's own formula, per level."""
    alpha, slope = 30e-6, 1 / 20e9
    pts = _points(alpha, slope)
    size = 2 if collective is Collective.p2p else n
    intra = fit_link(LinkLevel.intra_node, collective, size, size, pts, "t")
    prof = _profile([intra], nodes=1, per_node=8)
    for p in pts:
        assert collective_time_s(prof, collective, GroupPlacement(size, size), p.bytes) == pytest.approx(
            p.time_s, rel=1e-9)
    # across nodes, one rank per node
    inter = fit_link(LinkLevel.inter_node, collective, size, 1, pts, "t")
    prof = _profile([inter], nodes=size, per_node=1)
    for p in pts:
        assert collective_time_s(prof, collective, GroupPlacement(size, 1), p.bytes) == pytest.approx(
            p.time_s, rel=1e-9)


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


@pytest.mark.parametrize("collective", [Collective.all_reduce, Collective.all_gather, Collective.reduce_scatter,
                                        Collective.all_to_all])
def test_measured_placement_is_priced_as_measured_even_with_a_slower_intra_link(collective):
    """The 4-rank inter-node measurement (2 per node) holds its on-node legs already: bounding it by
    the intra-node link again would price it slower than it was measured. Other placements, and
    entries that do not say how they were measured, keep the bound."""
    pts = _points(50e-6, 1 / 5e9)
    link = fit_link(LinkLevel.inter_node, collective, 4, 2, pts, "t")
    assert link.ranks_per_node == 2
    slow_intra = LinkProfile(level=LinkLevel.intra_node, collective=collective, group_size=2, alpha_s=0,
                             busbw_bytes_per_s=1e9)
    prof = _profile([link, slow_intra])
    for p in pts:
        assert collective_time_s(prof, collective, GroupPlacement(4, 2), p.bytes) == pytest.approx(p.time_s, rel=1e-9)
    row = next(r for r in link_fit_report(prof) if r["level"] == "inter_node")
    assert row["worst_rel_err"] < 1e-9
    # the same entry without its placement: the intra-node bound applies and binds (slower)
    unknown = [link.model_copy(update={"ranks_per_node": None}), slow_intra]
    big = pts[-1]
    assert collective_time_s(_profile(unknown), collective, GroupPlacement(4, 2), big.bytes) > 1.2 * big.time_s
    # another collective priced from this entry (a profile without it falls back to it): bound included
    other = next(c for c in (Collective.all_gather, Collective.all_reduce) if c is not collective)
    assert collective_time_s(_profile([link, slow_intra]), other, GroupPlacement(4, 2), big.bytes) == pytest.approx(
        collective_time_s(_profile(unknown), other, GroupPlacement(4, 2), big.bytes), rel=1e-12)
    # another group size priced from this entry (8 ranks, 2 per node): the general rule, bound included
    at8 = collective_time_s(_profile([link, slow_intra], nodes=4), collective, GroupPlacement(8, 2), big.bytes)
    assert at8 == pytest.approx(collective_time_s(_profile(unknown, nodes=4), collective, GroupPlacement(8, 2),
                                                  big.bytes), rel=1e-12)


def test_host_waves_time_groups_sharing_a_host_one_at_a_time():
    """Only groups that share a host take turns: pairs on different machines still run side by side;
    groups spanning machines stay side by side too (in training they share each machine's network
    link); on one machine (or emulated nodes) every group gets a wave of its own."""
    pairs = [[0, 1], [2, 3]]
    across = [[0, 2], [1, 3]]
    two_hosts = ["a", "a", "b", "b"]
    assert host_waves(pairs, two_hosts) == [pairs]
    assert host_waves(across, two_hosts) == [across]
    one_host = ["a"] * 4  # emulated nodes on one machine
    assert host_waves(pairs, one_host) == [[[0, 1]], [[2, 3]]] and host_waves(pairs, None) == [[[0, 1]], [[2, 3]]]
    assert host_waves(across, one_host) == [[[0, 2]], [[1, 3]]]
    # two machines of 4 ranks: the pairs of a machine take turns, the machines side by side
    eight = ["a"] * 4 + ["b"] * 4
    assert host_waves([[0, 1], [2, 3], [4, 5], [6, 7]], eight) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


def test_timed_groups_one_per_crowded_host_all_on_hosts_with_a_core_per_rank():
    eight = ["a"] * 4 + ["b"] * 4
    waves = host_waves([[0, 1], [2, 3], [4, 5], [6, 7]], eight)
    assert timed_groups(waves, eight, None) == [[0, 1], [4, 5]]  # every host crowded: one group each
    assert timed_groups(waves, eight, {"a", "b"}) == [[0, 1], [4, 5]]
    assert timed_groups(waves, eight, {"a"}) == [[0, 1], [4, 5], [6, 7]]  # b has the cores: all of its pairs
    assert timed_groups(waves, eight, set()) == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert timed_groups([[[0, 1]], [[2, 3]]], None, set()) == [[0, 1]]  # no host names: one host, crowded


def test_crowded_hosts_count_the_cpus_a_hosts_ranks_may_use():
    from profiler.run import crowded_hosts

    assert crowded_hosts([("a", [0, 1])] * 4 + [("b", list(range(8)))] * 4) == {"a"}
    assert crowded_hosts([("a", [0, 1])] * 4) == {"a"}  # 4 ranks sharing 2 CPUs
    assert crowded_hosts([("a", [i]) for i in range(4)]) == set()  # each rank pinned to a core of its own
    assert crowded_hosts([("a", [0, 1]), ("a", [0, 1]), ("b", [0, 1]), ("b", [0, 1])]) == set()
    assert crowded_hosts([("a", list(range(8)))] * 2 + [("b", [0])] * 2) == {"b"}  # one host is enough


def test_oversubscribed_hosts_and_small_message_trials():
    assert oversubscribed(4, 2) and oversubscribed(3, 2) and oversubscribed(2, 0)
    assert not oversubscribed(2, 2) and not oversubscribed(8, 96)
    assert trials_for(4096, 5) == 15 and trials_for(256 << 10, 5) == 15
    assert trials_for((256 << 10) + 4, 5) == 5 and trials_for(16 << 20, 7) == 7


def test_calls_per_trial_are_cut_to_what_lasts_the_minimum_trial():
    assert reps_for(4096) == 8 and reps_for(MIB) == 4 and reps_for(16 * MIB) == 1
    # fast calls keep the count by size; a slow one needs fewer to last 8 ms, never none
    assert reps_within(4096, 50e-6, 0.008) == 8
    assert reps_within(4096, 3e-3, 0.008) == 3 and reps_within(4096, 5e-3, 0.008) == 2
    assert reps_within(4096, 0.02, 0.008) == 1 and reps_within(MIB, 1e-3, 0.008) == 4
    # no minimum, or no timing of the call: the count by size
    assert reps_within(4096, 5e-3, 0.0) == 8 and reps_within(4096, float("inf"), 0.008) == 8


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


def test_a_node_of_six_measures_its_whole_node_and_no_group_crosses_nodes():
    intra = {s.size: s.ranks for s in plan_groups(12, 6) if s.level is LinkLevel.intra_node}
    assert sorted(intra) == [2, 4, 6]
    assert intra[4] == [[0, 1, 2, 3], [6, 7, 8, 9]]  # not [4, 5, 6, 7]: ranks 6-7 are on the next node
    assert intra[6] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert intra[2] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert [s.size for s in plan_groups(3, 3) if s.level is LinkLevel.intra_node] == [2, 3]
    assert [s.size for s in plan_groups(2, 1) if s.level is LinkLevel.intra_node] == []


# ------------------------------------------------------------------------------ piecewise α-β


def _two_regimes() -> list[TimedPoint]:
    """In cache up to 2 MiB (20 µs + 50 GB/s), out of cache above (5 GB/s, 10x slower per byte)."""
    return [TimedPoint(bytes=b, time_s=20e-6 + b / 50e9 if b <= 2 << 20 else 60e-6 + b / 5e9) for b in SIZES]


def test_two_regimes_need_two_segments():
    pts = _two_regimes()
    assert fit_alpha_beta(pts).worst_rel_err > 0.2  # one line cannot follow the step
    segs = fit_segments(pts)
    assert len(segs) == 2
    assert max(s.fit.worst_rel_err for s in segs) < 1e-6
    lo, hi = segs
    assert lo.min_bytes is None and hi.max_bytes is None and lo.max_bytes == hi.min_bytes
    assert 2 << 20 < lo.max_bytes < 4 << 20  # between the last in-cache and the first out-of-cache size
    assert lo.fit.alpha_s == pytest.approx(20e-6) and 1 / lo.fit.slope_s_per_byte == pytest.approx(50e9)
    assert 1 / hi.fit.slope_s_per_byte == pytest.approx(5e9)


def test_one_regime_stays_one_line():
    assert len(fit_segments(_points(25e-6, 1 / 50e9, noise=0.05, seed=3))) == 1
    assert len(fit_segments(_points(25e-6, 1 / 50e9))) == 1


def test_segments_keep_three_points_and_at_most_three():
    # four regimes: never more than 3 segments, each from >= 3 points
    pts = [TimedPoint(bytes=b, time_s=(1 + 3 * (i // 4)) * (1e-5 + b / 1e10)) for i, b in enumerate(SIZES)]
    segs = fit_segments(pts)
    assert 2 <= len(segs) <= 3 and all(s.hi - s.lo >= 3 for s in segs)
    few = fit_segments(_two_regimes()[:5])  # 5 points: no split leaves 3 on each side
    assert len(few) == 1


@pytest.mark.parametrize("collective", [Collective.all_reduce, Collective.all_to_all, Collective.p2p])
def test_piecewise_link_priced_per_segment_by_the_planner(collective):
    pts = _two_regimes()
    size = 2 if collective is Collective.p2p else 4
    segs = fit_link_segments(LinkLevel.intra_node, collective, size, size, pts, "t")
    assert len(segs) == 2 and all("segment" in s.source for s in segs)
    assert all(s.points == sorted(pts, key=lambda p: p.bytes) for s in segs)  # every entry shows the whole measurement
    prof = _profile(segs, nodes=1, per_node=8)
    for p in pts:
        assert collective_time_s(prof, collective, GroupPlacement(size, size), p.bytes) == pytest.approx(
            p.time_s, rel=1e-6)
    rows = link_fit_report(prof)
    assert len(rows) == 1 and rows[0]["segments"] == 2 and rows[0]["points"] == len(pts)
    assert rows[0]["worst_rel_err"] < 1e-6 and rows[0]["r2"] == pytest.approx(1.0)
    # across nodes, 2 ranks per node: the stored per-rank network busbw still reproduces each segment
    inter = (fit_link_segments(LinkLevel.inter_node, collective, 4, 2, pts, "t")
             if collective is not Collective.p2p else [])
    if inter:
        fast = LinkProfile(level=LinkLevel.intra_node, collective=collective, group_size=2, alpha_s=0,
                           busbw_bytes_per_s=1e15)
        prof = _profile([*inter, fast])
        for p in pts:
            assert collective_time_s(prof, collective, GroupPlacement(4, 2), p.bytes) == pytest.approx(
                p.time_s, rel=1e-6)


def _seg(lo, hi, busbw, collective=Collective.all_reduce, n=2) -> LinkProfile:
    return LinkProfile(level=LinkLevel.intra_node, collective=collective, group_size=n, alpha_s=0.0,
                       busbw_bytes_per_s=busbw, min_bytes=lo, max_bytes=hi)


def test_planner_picks_covering_segment_else_nearest():
    segs = [_seg(1000, 10_000, 1e9), _seg(10_000, 100_000, 2e9), _seg(1_000_000, None, 4e9)]
    prof = _profile(segs, nodes=1)
    pick = lambda b: find_link(prof, LinkLevel.intra_node, Collective.all_reduce, 2, b).busbw_bytes_per_s  # noqa: E731
    assert pick(1000) == 1e9 and pick(9999) == 1e9 and pick(10_000) == 2e9 and pick(5e6) == 4e9
    assert pick(10) == 1e9  # below every segment: the smallest
    assert pick(200_000) == 2e9 and pick(800_000) == 4e9  # in the gap: the nearer by size ratio
    assert pick(None) == 4e9  # no size: the large-message segment (bulk transfers)
    t = collective_time_s(prof, Collective.all_reduce, GroupPlacement(2, 2), 50_000)
    assert t == pytest.approx(50_000 / 2e9)
    # the group-size lookup still takes the nearest measured size, then its segments
    other = _seg(None, None, 9e9, n=8)
    prof = _profile([*segs, other], nodes=1, per_node=8)
    assert find_link(prof, LinkLevel.intra_node, Collective.all_reduce, 8, 5000).busbw_bytes_per_s == 9e9
    assert find_link(prof, LinkLevel.intra_node, Collective.all_reduce, 2, 5000).busbw_bytes_per_s == 1e9


def test_segment_contract_validation():
    with pytest.raises(ValueError, match="min_bytes=4096 >= max_bytes=4096"):
        _seg(4096, 4096, 1e9)
    with pytest.raises(ValueError, match="overlapping segments"):
        _profile([_seg(None, 10_000, 1e9), _seg(5_000, None, 2e9)], nodes=1)
    with pytest.raises(ValueError, match="overlapping segments"):
        _profile([_seg(None, 10_000, 1e9), _seg(None, None, 2e9)], nodes=1)
    # touching ranges are fine; so are unbounded duplicates (older profiles) and other group sizes
    _profile([_seg(None, 10_000, 1e9), _seg(10_000, None, 2e9), _seg(None, None, 3e9, n=4)], nodes=1, per_node=4)
    _profile([_seg(None, None, 1e9), _seg(None, None, 2e9)], nodes=1)
    # round trip through JSON, and the schema names the new fields
    prof = _profile([_seg(None, 10_000, 1e9), _seg(10_000, None, 2e9)], nodes=1)
    again = ClusterProfile.model_validate_json(prof.model_dump_json())
    assert [(x.min_bytes, x.max_bytes) for x in again.links] == [(None, 10_000), (10_000, None)]
    props = ClusterProfile.model_json_schema()["$defs"]["LinkProfile"]["properties"]
    assert "min_bytes" in props and "max_bytes" in props


def test_link_chart_draws_segments_as_one_series():
    pages = pytest.importorskip("api.pages")
    segs = fit_link_segments(LinkLevel.intra_node, Collective.all_reduce, 2, 2, _two_regimes(), "t")
    plain = fit_link(LinkLevel.intra_node, Collective.all_gather, 2, 2, _points(1e-5, 1e-9), "t")
    charts = pages.link_charts(_profile([*segs, plain], nodes=1))
    svg = str(charts[0]["svg"])
    assert svg.count("<title>all_reduce (n=2), 2 segments fit</title>") == 1  # one line for both segments
    assert svg.count("<title>all_gather (n=2) fit</title>") == 1
    assert "<title>all_reduce (n=2) fit</title>" not in svg



def test_cold_arena_is_twice_the_cache_within_memory():
    mib = 1024 * 1024
    # twice the cache when that is larger than 4 copies of the largest size
    assert cold_arena_bytes(64 * mib, 480 * mib, 24 * 1024 * mib) == 960 * mib
    # 4 copies of the largest size when the cache is small; an unknown cache counts as 256 MiB
    assert cold_arena_bytes(256 * mib, 32 * mib, 64 * 1024 * mib) == 1024 * mib
    assert cold_arena_bytes(4 * mib, 0, 64 * 1024 * mib) == 512 * mib
    # capped at 1/8 of the available memory, but never below the largest copy (the two arenas then
    # take no more than the copy's own source and destination)
    assert cold_arena_bytes(64 * mib, 480 * mib, 2048 * mib) == 256 * mib
    assert cold_arena_bytes(64 * mib, 480 * mib, 256 * mib) == 64 * mib
    assert cold_arena_bytes(2048 * mib, 480 * mib, 6 * 1024 * mib) == 2048 * mib
    # a whole number of pages
    assert cold_arena_bytes(5000, 10_000, 1 << 40) % 4096 == 0


def test_cold_copies_take_fresh_page_aligned_slices_and_wrap():
    cold = ColdCopies(64 * 1024)  # 16 pages of 1024 floats
    assert cold.slot(10) == 0
    assert cold.slot(1024) == 1024  # the next page, not element 10
    assert cold.slot(2048) == 2048
    starts = [cold.slot(4096) for _ in range(3)]
    assert starts == [4096, 8192, 12288]
    assert cold.slot(4096) == 0  # 16384 + 4096 would overrun: back to the start
    with pytest.raises(ValueError, match="does not fit"):
        cold.slot(cold.numel + 1)
    # a copy moves data from one arena to the other, slice by slice
    fwd = cold.copy_fn(4096, forward=True)
    fwd()
    copied = cold.b[cold.offset - 1024:cold.offset]
    assert bool((copied == 1.0).all())
    assert float(cold.b.sum()) == 1024.0  # only that slice


def test_last_level_cache_read_from_sysfs(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "480M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "uevent").write_text("")
    assert last_level_cache_bytes(str(tmp_path)) == 480 * 1024 * 1024
    assert last_level_cache_bytes(str(tmp_path / "missing")) == 0


def test_the_cache_a_rank_can_fill_sums_the_l3_instances_of_its_cpus(tmp_path):
    """An EPYC-like host: each pair of CPUs shares a 32 MiB L3 (one CCX), each CPU has its own 1 MiB
    L2. A process on all four CPUs can fill 64 MiB; one on CPUs 0-1 32 MiB; cpu0's view alone says 32."""
    for cpu in range(4):
        for index, level, size, shared in (("index2", 2, "1024K", str(cpu)),
                                           ("index3", 3, "32768K", "0-1" if cpu < 2 else "2-3")):
            d = tmp_path / f"cpu{cpu}" / "cache" / index
            d.mkdir(parents=True)
            (d / "level").write_text(f"{level}\n")
            (d / "size").write_text(size + "\n")
            (d / "shared_cpu_list").write_text(shared + "\n")
    MiB = 1 << 20
    assert reachable_cache_bytes(str(tmp_path), [0, 1, 2, 3], threads=4) == 64 * MiB
    assert reachable_cache_bytes(str(tmp_path), [0, 1], threads=4) == 32 * MiB
    assert reachable_cache_bytes(str(tmp_path), [1, 3], threads=2) == 64 * MiB
    assert reachable_cache_bytes(str(tmp_path), [0, 1, 2, 3], threads=1) == 32 * MiB  # one thread, one CCX
    assert last_level_cache_bytes(str(tmp_path / "cpu0" / "cache")) == 32 * MiB
    # entries without level / sharing: one CPU's largest cache, as before
    for cpu in range(4):
        for index in ("index2", "index3"):
            (tmp_path / f"cpu{cpu}" / "cache" / index / "level").unlink()
    assert reachable_cache_bytes(str(tmp_path), [0, 1, 2, 3], threads=4) == 32 * MiB
    assert reachable_cache_bytes(str(tmp_path / "nothing"), [0]) == 0
    assert reachable_cache_bytes() > 0  # this machine's sysfs


def test_cpu_host_copies_stream_arenas_sized_by_the_cache(monkeypatch):
    import torch

    import profiler.identity

    # a 1 MiB cache: 4 MiB arenas (4 copies of the largest size), not 2x a server's L3 in a unit test
    monkeypatch.setattr(profiler.identity, "reachable_cache_bytes", lambda threads=None: 1 << 20)
    links, notes = measure_host_device(torch.device("cpu"), [4096, 65536, 1 << 20], trials=1)
    assert {link.collective for link in links} == {Collective.host_to_device, Collective.device_to_host}
    for link in links:
        assert "two 4 MiB arenas (4.0x the 1 MiB last-level cache)" in link.source
        assert len(link.points) == 3 and all(p.time_s > 0 for p in link.points)
