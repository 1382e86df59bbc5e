"""α-β fits of timed points, apart from measuring them (no torch here): :func:`fit_alpha_beta` fits
``t = alpha_s + slope · bytes`` (``alpha_s, slope ≥ 0``) by minimising the worst relative error (a small
linear program), :func:`fit_segments` splits the sizes into up to 3 contiguous ranges where one line misses
by more than 10% and more segments clearly help, and :func:`fit_link_segments` turns each segment into a
:class:`~planner.contracts.LinkProfile` whose bus bandwidth is in the planner's convention:

- intra-node, and across nodes with one rank per node: ``busbw = ring_factor(collective, n) / slope``
  (2(n-1)/n all-reduce; (n-1)/n all-gather, reduce-scatter, all-to-all; 1 p2p);
- across nodes with ``g > 1`` ranks per node: the per-rank network busbw ``factor / (g · slope)`` (ring
  collectives) or ``((n-g)/n) / slope`` (all-to-all), with ``ranks_per_node = g`` recorded, so that the
  planner's ``min(intra busbw, g · network busbw)`` reproduces the fit for a group of the measured shape.

:func:`link_fit_report` checks a profile's links the way the planner uses them: it predicts every measured
point with ``collective_time_s`` (R², worst relative error).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from planner.contracts import ClusterProfile, Collective, LinkLevel, LinkProfile
from planner.contracts.cluster import MIN_FLAT_SLOPE, TimedPoint, link_key, link_points
from planner.cost.comm import GroupPlacement, collective_time_s, link_segments, pick_segment, ring_factor


@dataclass
class Fit:
    alpha_s: float
    slope_s_per_byte: float
    r2: float
    worst_rel_err: float


def _r2(ts: list[float], pred: list[float]) -> float:
    mean = statistics.fmean(ts)
    ss_tot = sum((t - mean) ** 2 for t in ts)
    ss_res = sum((t - p) ** 2 for t, p in zip(ts, pred))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)


def fit_alpha_beta(points: list[TimedPoint]) -> Fit:
    """Minimax relative-error fit of ``t = alpha + slope·bytes`` with ``alpha, slope ≥ 0``.

    The planner needs a *bounded* error on every message size, so the fit minimises the largest
    ``|alpha + slope·b_i - t_i| / t_i`` (a Chebyshev fit on relative error: a 3-variable linear
    program, :func:`_minimax_lp`). Minimax solutions need not be unique (two points can pin the
    worst error while the line still pivots), so among the optimal lines it takes the one with the
    smallest sum of relative errors. A single point is fitted through the origin.

    R² is the ordinary coefficient of determination of the times; ``worst_rel_err`` is the largest
    ``|pred - t| / t`` over the points.
    """
    if not points:
        raise ValueError("no points to fit")
    bs = [float(p.bytes) for p in points]
    ts = [float(p.time_s) for p in points]
    if len(points) < 2 or len(set(bs)) < 2:
        alpha, slope = 0.0, statistics.fmean(t / b for t, b in zip(ts, bs)) if min(bs) > 0 else 0.0
    else:
        alpha, slope, _ = _minimax_lp(bs, ts, tie_break=True)
    pred = [alpha + slope * b for b in bs]
    worst = max(abs(p - t) / t for p, t in zip(pred, ts))
    return Fit(alpha, slope, _r2(ts, pred), worst)


def minimax_rel_err(points: list[TimedPoint]) -> float:
    """The smallest worst relative error any line ``alpha + slope·bytes`` (both ≥ 0) reaches on
    ``points`` (the first stage of :func:`fit_alpha_beta`, for choosing breakpoints)."""
    if len(points) < 2:
        return 0.0
    return _minimax_lp([float(p.bytes) for p in points], [float(p.time_s) for p in points], tie_break=False)[2]


def _minimax_lp(bs: list[float], ts: list[float], tie_break: bool) -> tuple[float, float, float]:
    """``min e  s.t.  |alpha + slope·b_i - t_i| ≤ e·t_i,  alpha, slope ≥ 0`` (GLOP), then, when
    ``tie_break``, ``min Σ|alpha + slope·b_i - t_i| / t_i`` with ``e`` held at its optimum.
    Scaled to O(1) unknowns (bytes by the largest, times by the median). Returns (alpha, slope, e)."""
    from ortools.linear_solver import pywraplp

    b_scale, t_scale = max(bs), statistics.median(ts)
    xs = [b / b_scale for b in bs]
    taus = [t / t_scale for t in ts]
    solver = pywraplp.Solver.CreateSolver("GLOP")
    inf = solver.infinity()
    a = solver.NumVar(0.0, inf, "alpha")
    s = solver.NumVar(0.0, inf, "slope")
    e = solver.NumVar(0.0, inf, "worst")
    rel = [a * (1.0 / tau) + s * (x / tau) - 1.0 for x, tau in zip(xs, taus)]
    for r in rel:
        solver.Add(r <= e)
        solver.Add(-r <= e)
    solver.Minimize(e)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:  # pragma: no cover - always feasible (alpha = slope = 0, e = 1)
        raise RuntimeError("minimax α-β fit: GLOP found no optimum")
    best = e.solution_value()
    if tie_break:
        e.SetUb(best * (1 + 1e-9) + 1e-12)
        ds = [solver.NumVar(0.0, inf, f"d{i}") for i in range(len(rel))]
        for d, r in zip(ds, rel):
            solver.Add(r <= d)
            solver.Add(-r <= d)
        solver.Minimize(sum(ds))
        if solver.Solve() != pywraplp.Solver.OPTIMAL:  # pragma: no cover - the first stage's optimum is feasible
            raise RuntimeError("minimax α-β fit: GLOP found no optimum for the tie-break")
    alpha, slope = a.solution_value() * t_scale, s.solution_value() * t_scale / b_scale
    alpha, slope = max(alpha, 0.0), max(slope, 0.0)
    worst = max(abs(alpha + slope * b - t) / t for b, t in zip(bs, ts))
    return alpha, slope, worst


MIN_SLOPE = MIN_FLAT_SLOPE  # s/byte: a flat fit still needs a positive bandwidth (1e18 B/s: LinkProfile.is_flat)


def busbw_from_slope(collective: Collective, slope: float, group_size: int, per_node: int, level: LinkLevel) -> float:
    """The busbw the planner's formula needs so its byte term equals ``slope·bytes`` (module docstring)."""
    slope = max(slope, MIN_SLOPE)
    n, g = group_size, per_node
    if collective is Collective.p2p:
        return 1.0 / slope
    if level is LinkLevel.inter_node and g > 1:
        if collective is Collective.all_to_all:
            return ((n - g) / n) / slope
        return ring_factor(collective, n) / (g * slope)
    return ring_factor(collective, n) / slope


MIN_SEGMENT_POINTS = 3
MAX_SEGMENTS = 3
SPLIT_ABOVE = 0.10  # a single line within 10% everywhere is kept as it is
SPLIT_GAIN = 0.7  # another segment must cut the worst relative error to 70% of it or less ...
SPLIT_MIN_DROP = 0.05  # ... and by 5 percentage points at least


@dataclass
class Segment:
    """Points ``lo..hi-1`` (sorted by size) fitted by one line, covering ``[min_bytes, max_bytes)``."""

    lo: int
    hi: int
    fit: Fit
    min_bytes: int | None
    max_bytes: int | None


def _best_split(points: list[TimedPoint], k: int, min_points: int) -> tuple[float, list[tuple[int, int]]] | None:
    """The split of the sorted points into ``k`` contiguous runs (each ≥ ``min_points``) whose worst
    per-run fit error is smallest: (worst error, [(lo, hi), ...])."""
    n = len(points)
    if k * min_points > n:
        return None
    cache: dict[tuple[int, int], float] = {}

    def err(lo: int, hi: int) -> float:
        if (lo, hi) not in cache:
            cache[(lo, hi)] = minimax_rel_err(points[lo:hi])
        return cache[(lo, hi)]

    best: tuple[float, list[tuple[int, int]]] | None = None

    def walk(lo: int, left: int, runs: list[tuple[int, int]], worst: float) -> None:
        nonlocal best
        if best is not None and worst >= best[0]:
            return
        if left == 1:
            if n - lo >= min_points:
                w = max(worst, err(lo, n))
                if best is None or w < best[0]:
                    best = (w, [*runs, (lo, n)])
            return
        for hi in range(lo + min_points, n - (left - 1) * min_points + 1):
            walk(hi, left - 1, [*runs, (lo, hi)], max(worst, err(lo, hi)))

    walk(0, k, [], 0.0)
    return best


def fit_segments(points: list[TimedPoint], max_segments: int = MAX_SEGMENTS,
                 min_points: int = MIN_SEGMENT_POINTS) -> list[Segment]:
    """Piecewise α-β: 1 to ``max_segments`` contiguous size ranges, each its own line.

    Breakpoints minimise the worst relative error over all points (each range's minimax line,
    :func:`minimax_rel_err`); more segments are taken only when they clearly help (the one-line fit
    misses by more than 10%, and the count taken is the smallest that no larger count beats by
    cutting the worst error to ≤ 70% of it and by ≥ 5 points). Each range has ≥ ``min_points`` points. Ranges meet at
    the geometric mean of the neighbouring measured sizes; the first starts and the last ends unbounded.
    """
    pts = sorted(points, key=lambda p: p.bytes)
    options = [(minimax_rel_err(pts), [(0, len(pts))])]
    if options[0][0] > SPLIT_ABOVE:
        for k in range(2, max_segments + 1):
            found = _best_split(pts, k, min_points)
            if found is None:
                break
            options.append(found)

    def clearly_better(more: float, fewer: float) -> bool:
        return more <= SPLIT_GAIN * fewer and fewer - more >= SPLIT_MIN_DROP

    # the fewest segments that no larger count clearly beats (2 may barely help where 3 do)
    pick = next(i for i, (w, _) in enumerate(options) if not any(clearly_better(m, w) for m, _ in options[i + 1:]))
    runs = options[pick][1]
    out = []
    for i, (lo, hi) in enumerate(runs):
        lo_b = None if i == 0 else int(round(math.sqrt(pts[lo - 1].bytes * pts[lo].bytes)))
        hi_b = None if i == len(runs) - 1 else int(round(math.sqrt(pts[hi - 1].bytes * pts[hi].bytes)))
        out.append(Segment(lo, hi, fit_alpha_beta(pts[lo:hi]), lo_b, hi_b))
    return out


def fit_link(level: LinkLevel, collective: Collective, group_size: int, per_node: int, points: list[TimedPoint],
             source: str) -> LinkProfile:
    """One line through all the points (an unsegmented entry)."""
    return fit_link_segments(level, collective, group_size, per_node, points, source, max_segments=1)[0]


def fit_link_segments(level: LinkLevel, collective: Collective, group_size: int, per_node: int,
                      points: list[TimedPoint], source: str, max_segments: int = MAX_SEGMENTS) -> list[LinkProfile]:
    """The link's entries: one per fitted segment (:func:`fit_segments`). Each carries all of the
    link's points (a segment's fit and ``fit_r2`` use those in its range), so every entry still
    shows the whole measurement."""
    pts = sorted(points, key=lambda p: p.bytes)
    segs = fit_segments(pts, max_segments)
    out = []
    for seg in segs:
        note = "" if len(segs) == 1 else f"; segment {len(out) + 1} of {len(segs)} (piecewise α-β)"
        if level is LinkLevel.host_device:
            busbw = 1.0 / max(seg.fit.slope_s_per_byte, MIN_SLOPE)
        else:
            busbw = busbw_from_slope(collective, seg.fit.slope_s_per_byte, group_size, per_node, level)
        out.append(LinkProfile(level=level, collective=collective, group_size=group_size, alpha_s=seg.fit.alpha_s,
                               busbw_bytes_per_s=busbw, points=pts, fit_r2=seg.fit.r2,
                               source=source + note, min_bytes=seg.min_bytes, max_bytes=seg.max_bytes,
                               ranks_per_node=per_node))
    return out


# ---------------------------------------------------------------------------------------- report


def link_placement(profile: ClusterProfile, link: LinkProfile) -> GroupPlacement:
    """Where the measured group sat: intra-node groups live on one node; inter-node groups are one
    rank per node (size = nodes) or all ranks (size/nodes per node)."""
    n = link.group_size or 2
    if link.level is LinkLevel.inter_node:
        return GroupPlacement(n, max(1, n // profile.num_nodes))
    return GroupPlacement(n, n)


def link_fit_report(profile: ClusterProfile, *, print_table: bool = False) -> list[dict]:
    """For each measured link (its segments together): R² and worst relative error of the planner's
    own prediction (``collective_time_s`` on this profile, the link looked up as the planner does)
    vs the points."""
    rows: list[dict] = []
    seen: set = set()
    for first in profile.links:
        key = link_key(first) if first.segmented else id(first)
        if not first.points or key in seen:
            continue
        seen.add(key)
        segs = link_segments(profile.links, first.level, first.collective, first.group_size)
        if not first.segmented:
            segs = [first]  # unsegmented duplicates (older profiles): each judged as before, the first here
        points = link_points(segs)
        if first.level is LinkLevel.host_device:
            pred = [(lambda s: s.alpha_s + p.bytes / s.busbw_bytes_per_s)(pick_segment(segs, p.bytes)) for p in points]
        else:
            # only this level's entry of this group size, plus the intra-node entries the planner
            # may take the minimum with, so the prediction is of *this* link
            others = [x for x in profile.links if x.level is LinkLevel.intra_node and all(x is not s for s in segs)
                      and first.level is LinkLevel.inter_node]
            sub = profile.model_copy(update={"links": [*segs, *others]})
            group = link_placement(profile, first)
            pred = [collective_time_s(sub, first.collective, group, p.bytes) for p in points]
        ts = [p.time_s for p in points]
        errs = [(q - t) / t for q, t in zip(pred, ts)]
        worst_i = max(range(len(errs)), key=lambda i: abs(errs[i]))
        big = pick_segment(segs, None)
        rows.append({
            "level": first.level.value, "collective": first.collective.value, "group_size": first.group_size,
            "alpha_us": big.alpha_s * 1e6, "busbw_GBps": big.busbw_bytes_per_s / 1e9, "segments": len(segs),
            "r2": _r2(ts, pred), "fit_r2": big.fit_r2, "worst_rel_err": abs(errs[worst_i]),
            "worst_at_bytes": points[worst_i].bytes, "points": len(ts),
        })
    if print_table:
        print(f"{'level':<12}{'collective':<16}{'n':>3}{'seg':>4}{'alpha us':>10}{'busbw GB/s':>12}{'R2':>8}"
              f"{'worst err':>11}  at   (α, busbw of the largest-message segment)")
        for r in rows:
            print(f"{r['level']:<12}{r['collective']:<16}{r['group_size'] or '-':>3}{r['segments']:>4}"
                  f"{r['alpha_us']:>10.1f}{r['busbw_GBps']:>12.3f}{r['r2']:>8.4f}{r['worst_rel_err'] * 100:>10.1f}%"
                  f"  {r['worst_at_bytes']} B")
    return rows


# ----------------------------------------------------------------------------------------- measure
