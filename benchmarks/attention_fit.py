"""How well does the planner price attention it did not measure, from a GPU profile's table?

Offline (no GPU needed): reads measured profiles and prints, for the planner's attention fit
(:func:`planner.cost.compute.attention_time_s`) on each of its two coordinate sets side by side (the
heads fit GPU tables had before and CPU tables keep; the thread-block fit GPU tables have now), and
which one the planner takes for the profile:
  - leave-one-out over a table's bf16 points: each point priced from the others;
  - leave-one-layout-out: each head layout's points priced from the other layouts' (a model's heads
    the grid never measured);
  - with ``--quick``: the quick profile's table pricing the full table's points it does not hold,
    and the full table cut to the quick grid's lengths and layouts pricing the rest;
  - with ``--step``: the executor step's attention (tests/fixtures/h200_step_measured.json) against
    its measured kernel time.

    .venv/bin/python benchmarks/attention_fit.py tests/fixtures/h200_full_profile.json \\
        --quick planner/data/measured/nvidia-h200-1x1.json --step tests/fixtures/h200_step_measured.json
    .venv/bin/python benchmarks/attention_fit.py cpu-full.json --precision fp32   # a full CPU profile
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import planner.cost.compute as cc  # noqa: E402
from planner.contracts import AttentionPoint, ClusterProfile, ModelSpec, Precision  # noqa: E402
from profiler.compute import default_grid  # noqa: E402

# the coordinates CPU tables are fitted on (and GPU tables were); the thread-block coordinates GPU
# tables are fitted on now, each applied to any table (the planner takes one: attention_coords)
FITS = {
    "heads fit (log seq, log b*h, log b*kv, log d)": cc.heads_coords,
    "thread-block fit (log seq, log b*h*seq/128, log d)": cc.thread_block_coords,
}


@contextmanager
def fit(name: str) -> Iterator[None]:
    """The planner's attention fit on ``FITS[name]``'s coordinates, whatever table it prices."""
    original = cc.attention_coords
    cc.attention_coords = lambda cpu: FITS[name]
    try:
        yield
    finally:
        cc.attention_coords = original


def _with(profile: ClusterProfile, table: list[AttentionPoint]) -> ClusterProfile:
    return profile.model_copy(update={"compute": profile.compute.model_copy(update={"attention": table})})


def _errors(profile: ClusterProfile, points: list[AttentionPoint]) -> list[float]:
    out = []
    for a in points:
        f, b = cc.attention_time_s(profile, batch=a.batch, q_len=a.seq_length, kv_len=a.seq_length, heads=a.num_heads,
                                   kv_heads=a.num_kv_heads, qk_dim=a.head_dim, v_dim=a.head_dim,
                                   precision=a.precision, causal=a.causal, flash=True)
        out += [abs(f - a.forward_time_s) / a.forward_time_s, abs(b - a.backward_time_s) / a.backward_time_s]
    return out


def _summary(errs: list[float]) -> str:
    """Of a list of relative errors (a point's forward and backward time each count)."""
    return (f"median {statistics.median(errs) * 100:5.1f}%, {sum(e <= 0.15 for e in errs):2d}/{len(errs)} within 15%, "
            f"worst {max(errs) * 100:5.1f}%")


def _layout(a: AttentionPoint) -> tuple[int, int, int]:
    return a.num_heads, a.num_kv_heads, a.head_dim


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("full", help="a GPU profile with several head layouts (e.g. the full H200 fixture)")
    ap.add_argument("--quick", help="a quick profile of the same GPU")
    ap.add_argument("--step", help="tests/fixtures/h200_step_measured.json")
    ap.add_argument("--precision", default="bf16", help="the table's points in this precision")
    a = ap.parse_args(argv)
    precision = Precision(a.precision)
    full = ClusterProfile.model_validate_json(Path(a.full).read_text())
    quick = ClusterProfile.model_validate_json(Path(a.quick).read_text()) if a.quick else None
    bf16 = [p for p in full.compute.attention if p.precision is precision]
    quick_grid = default_grid(quick=True, device_type="cuda").attention  # (batch, seq, heads, kv, dim)
    quick_layouts = {(h, kv, d) for _, _, h, kv, d in quick_grid}
    quick_seqs = [s for _, s, _, _, _ in quick_grid]
    in_quick_grid = [p for p in bf16 if _layout(p) in quick_layouts
                     and min(quick_seqs) <= p.seq_length <= max(quick_seqs)]
    rest = [p for p in bf16 if p not in in_quick_grid]
    taken = next(name for name, c in FITS.items() if c is cc.attention_coords(full.is_cpu))
    print(f"{full.name}: {len(bf16)} {precision.value} attention points in {len({_layout(p) for p in bf16})} head "
          f"layouts; the planner takes the {taken.split(' (')[0]}")
    measured = json.loads(Path(a.step).read_text()) if a.step else None
    for name in FITS:
        print(f"\n{name}")
        with fit(name):
            loo = [e for p in bf16
                   for e in _errors(_with(full, [x for x in full.compute.attention if x is not p]), [p])]
            print(f"  leave one point out:              {_summary(loo)}")
            lolo = [e for p in bf16 for e in _errors(
                _with(full, [x for x in full.compute.attention if _layout(x) != _layout(p)]), [p])]
            print(f"  leave its head layout out:        {_summary(lolo)}")
            if in_quick_grid and rest:
                print(f"  the quick grid's share of the table pricing the other {len(rest)} points: "
                      f"{_summary(_errors(_with(full, in_quick_grid), rest))}")
                one_layout = [p for p in in_quick_grid if _layout(p) == (32, 8, 128)]
                print(f"  ... and of it 32/8 alone (the quick grid before) pricing the same points: "
                      f"{_summary(_errors(_with(full, one_layout), rest))}")
            if quick is not None:
                one = [p for p in quick.compute.attention if p.precision is precision]
                held = {(_layout(q), q.seq_length) for q in one}
                others = [p for p in bf16 if (_layout(p), p.seq_length) not in held]
                print(f"  the quick profile ({len({_layout(p) for p in one})} layout) pricing the full table's "
                      f"other {len(others)} points: {_summary(_errors(quick, others))}")
            if measured:
                model = ModelSpec(**measured["model"])
                seq = measured["training"]["seq_length"]
                for run in measured["runs"]:
                    mb = run["micro_batch_size"]
                    for label, profile in (("full", full), ("quick", quick)):
                        if profile is None:
                            continue
                        f, b = cc.attention_time_s(profile, batch=mb, q_len=seq, kv_len=seq,
                                                   heads=model.num_attention_heads, kv_heads=model.kv_heads,
                                                   qk_dim=model.head_size, v_dim=model.head_size,
                                                   precision=Precision.bf16, causal=True, flash=True)
                        steps = model.num_layers * measured["training"]["global_batch_size"] // mb
                        print(f"  executor step, micro-batch {mb}, {label} profile: {(f + b) * steps * 1e3:6.2f} ms "
                              f"against {run['attention_kernels_s'] * 1e3:.2f} ms of kernels "
                              f"({(f + b) * steps / run['attention_kernels_s']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
