"""Pipeline schedules: how per-stage forward/backward times compose into one step.

For stage times ``t_i = f_i + b_i`` (one micro-batch, all of the stage's chunks), ``m``
micro-batches, ``p`` stages and ``v`` virtual stages per rank:

- GPipe and 1F1B: ``T = Σ t_i + (m - 1)·max t_i`` — for equal stages ``(m + p - 1)·t``, bubble
  ``(p - 1)/m`` of the work (Narayanan et al. 2021, §2.2).
- Interleaved 1F1B: ``T = m·max t_i + (Σ t_i - max t_i)/v`` — for equal stages bubble ``(p-1)·t/v``.
- Zero-bubble ZB-H1 (Qi et al. 2024): the weight-gradient half of backward ``W`` fills the cool-down,
  bubble ``(p - 1)(F + B - W)``; with ``B = W = b/2`` that is ``Σ_{i≠max} f_i``.
"""

from __future__ import annotations

from planner.contracts import Schedule


def pipeline_time_s(
    schedule: Schedule, forward_s: list[float], backward_s: list[float], num_micro_batches: int, virtual: int = 1
) -> tuple[float, float]:
    """(time of the forward/backward phase of one step, bubble time) for the stage times given."""
    m = num_micro_batches
    totals = [f + b for f, b in zip(forward_s, backward_s)]
    slowest = max(totals)
    critical = m * slowest
    if len(totals) == 1:
        return critical, 0.0
    if schedule is Schedule.interleaved_1f1b:
        bubble = (sum(totals) - slowest) / virtual
    elif schedule is Schedule.zero_bubble:
        # the slowest stage; among equally slow ones the one whose forward is longest (its
        # forwards are the ones that do not fill another stage's bubble)
        i_max = max(range(len(totals)), key=lambda i: (totals[i], forward_s[i]))
        bubble = sum(f for i, f in enumerate(forward_s) if i != i_max)
    else:
        bubble = sum(totals) - slowest
    return critical + bubble, bubble
