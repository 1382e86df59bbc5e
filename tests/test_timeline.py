"""The pipeline schedule simulation behind the plan page's timeline (api/timeline.py)."""

from __future__ import annotations

import itertools

import pytest

from api.timeline import SCHEDULES, V_SCHEDULES, ScheduleError, busy, makespan, simulate, stage_of

CASES = [(1, 4), (2, 2), (4, 8), (4, 3), (8, 16), (3, 7)]


def check_consistent(boxes, p: int, m: int, v: int = 1, schedule: str = "1f1b") -> None:  # noqa: ANN001
    """No overlap on a rank; every (micro-batch, chunk) runs forward and backward once per rank;
    forward on virtual stage s starts after it ended on s-1, backward after it ended on s+1 (the stage of a
    rank's chunk as the schedule places it)."""
    assert len(boxes) == p
    end = {}
    for r, rank in enumerate(boxes):
        ordered = sorted(rank, key=lambda b: b.start_s)
        for a, b in itertools.pairwise(ordered):
            assert b.start_s >= a.end_s - 1e-12, (r, a, b)
        for b in rank:
            assert b.end_s > b.start_s
            key = (b.kind, b.microbatch, stage_of(schedule, p, v, r, b.chunk))
            assert key not in end
            end[key] = b
    for j in range(m):
        for s in range(p * v):
            f, b = end[("F", j, s)], end[("B", j, s)]
            if s > 0:
                assert f.start_s >= end[("F", j, s - 1)].end_s - 1e-12
            if s < p * v - 1:
                assert b.start_s >= end[("B", j, s + 1)].end_s - 1e-12
            assert b.start_s >= f.end_s - 1e-12
            if ("W", j, s) in end:
                assert end[("W", j, s)].start_s >= b.end_s - 1e-12


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", CASES)
def test_equal_stages_take_m_plus_p_minus_1_slots(schedule: str, p: int, m: int) -> None:
    f, b = 1.0, 2.0
    boxes = simulate(schedule, [f] * p, [b] * p, m)
    check_consistent(boxes, p, m)
    assert makespan(boxes) == pytest.approx((m + p - 1) * (f + b))
    assert all(busy(rank) == pytest.approx(m * (f + b)) for rank in boxes)


def test_1f1b_keeps_at_most_p_minus_rank_microbatches_in_flight() -> None:
    p, m = 4, 8
    boxes = simulate("1f1b", [1.0] * p, [2.0] * p, m)
    for r, rank in enumerate(boxes):
        in_flight = peak = 0
        for b in sorted(rank, key=lambda b: b.start_s):
            in_flight += 1 if b.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == min(m, p - r)
    gpipe = simulate("gpipe", [1.0] * p, [2.0] * p, m)
    assert [b.kind for b in gpipe[0]] == ["F"] * m + ["B"] * m


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (2, 4, 3), (8, 16, 4), (4, 4, 2)])
def test_interleaved_shrinks_the_bubble_by_v(p: int, m: int, v: int) -> None:
    f, b = 1.0, 2.0
    boxes = simulate("interleaved_1f1b", [f] * p, [b] * p, m, v)
    check_consistent(boxes, p, m, v)
    assert makespan(boxes) == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)
    assert {bx.chunk for bx in boxes[0]} == set(range(v))


@pytest.mark.parametrize("p,m", CASES)
def test_zero_bubble_splits_backward_and_is_no_slower_than_1f1b(p: int, m: int) -> None:
    f, b = 1.0, 2.0
    zb = simulate("zero_bubble", [f] * p, [b] * p, m)
    check_consistent(zb, p, m)
    for rank in zb:
        assert sorted(bx.kind for bx in rank).count("W") == m
        assert busy(rank) == pytest.approx(m * (f + b))
        assert all(bx.end_s - bx.start_s == pytest.approx(b / 2) for bx in rank if bx.kind in "BW")
    assert m * (f + b) - 1e-9 <= makespan(zb) <= makespan(simulate("1f1b", [f] * p, [b] * p, m)) + 1e-9
    if p > 1 and m >= p:
        assert makespan(zb) < (m + p - 1) * (f + b)  # W's fill part of the cooldown bubble


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_uneven_stages_stay_consistent(schedule: str) -> None:
    fwd = [0.01, 0.05, 0.05, 0.04]
    bwd = [0.02, 0.11, 0.10, 0.09]
    v = 2 if schedule == "interleaved_1f1b" or schedule in V_SCHEDULES else 1
    boxes = simulate(schedule, fwd, bwd, 8, v)
    check_consistent(boxes, 4, 8, v, schedule)
    slowest = max(f + b for f, b in zip(fwd, bwd))
    assert makespan(boxes) >= 8 * slowest - 1e-12


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (3, 7)])
def test_v_schedules_run_both_chunks_of_every_rank_and_beat_1f1b(schedule: str, p: int, m: int) -> None:
    f, b = 1.0, 2.0
    boxes = simulate(schedule, [f] * p, [b] * p, m, 2)
    check_consistent(boxes, p, m, 2, schedule)
    # rank 0 runs the first and the last chunk: every micro-batch's first forward and its last one
    assert {bx.chunk for bx in boxes[0] if bx.kind == "F"} == {0, 1}
    assert all(busy(rank) == pytest.approx(m * (f + b)) for rank in boxes)
    if m >= 2 * p:
        assert makespan(boxes) < makespan(simulate("1f1b", [f] * p, [b] * p, m))


def test_bad_input_is_a_schedule_error() -> None:
    with pytest.raises(ScheduleError):
        simulate("pipedream", [1.0], [1.0], 1)
    with pytest.raises(ScheduleError):
        simulate("1f1b", [1.0, 1.0], [1.0], 1)
    with pytest.raises(ScheduleError):
        simulate("1f1b", [1.0], [1.0], 0)
    with pytest.raises(ScheduleError):
        simulate("1f1b", [], [], 1)
