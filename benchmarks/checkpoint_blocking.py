"""Checkpoint blocking time: predicted against measured, on 4 CPU ranks, synchronous and asynchronous.

The profile (``--profile P.json``, or ``autopar profile --quick`` on 4 ranks here) measures saves of states of
4 and 32 MiB per rank in 16 and 128 parameter tensors with the executor's own checkpointer and fits a line per
mode (``profiler/checkpoint.py``). This script then runs the executor on a model of a third size (39 parameter
tensors, ~520 MB of fp32 weights and AdamW states) under plans that hold and write different shares of it
(DDP: every rank holds all of it and writes a quarter; ZeRO-3: a quarter each; TP 2 x DP 2), saving after every
step, once with ``dcp.save`` and once with ``dcp.async_save``. The prediction is the goodput's
(``planner.cost.goodput.plan_goodput`` on the plan's own prediction): each mode's blocking time, and the
asynchronous write. Measured: the median over each run's saves after its first (the first sets up: the async
save's process group and thread, DCP's first plan), the first shown apart, with the spread of the saves
(min..max) beside it: on this VM's 2 shared cores that spread is the bound on what can be judged. Target: within
25%.

    .venv/bin/python benchmarks/checkpoint_blocking.py [--profile P.json] [--steps 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpu_bench import cpu_profile, torchrun  # noqa: E402  (benchmarks/cpu_bench.py)

from planner.contracts import (  # noqa: E402
    ClusterProfile,
    ModelSpec,
    ParallelLayout,
    RunReport,
    TrainingConfig,
    TrainingGoal,
)

SPEC = ModelSpec(name="checkpoint-bench", num_layers=4, hidden_size=512, num_attention_heads=8, num_kv_heads=2,
                 ffn_hidden_size=1408, vocab_size=32768)
TRAINING = TrainingConfig(seq_length=32, global_batch_size=8, precision="fp32")
LAYOUTS = {"dp4": {"dp_shard": 4}, "zero3": {"dp_shard": 4, "zero_stage": 3}, "tp2dp2": {"dp_shard": 2, "tp": 2}}
TARGET = 0.25


def predicted(layout: dict, profile: ClusterProfile, path: Path) -> dict[str, tuple[float, float]]:
    """Write the plan to ``path``; mode -> (blocking, write) seconds the goodput predicts for it."""
    from planner.cost.goodput import plan_goodput
    from planner.tune import plan_for

    plan = plan_for(SPEC, TRAINING, ParallelLayout(**layout), profile)
    path.write_text(plan.model_dump_json())
    good = plan_goodput(SPEC, TRAINING, profile, plan.layout, 4, plan.prediction, TrainingGoal(steps=1000), "autopar")
    return {c.mode: (c.blocking_s, c.write_s) for c in (good.chosen, good.other) if c is not None}


def measured(plan: Path, steps: int, tmp: Path, use_async: bool) -> RunReport:
    """The executor's run of ``plan`` saving after every step (sync or async)."""
    out, ckpt = tmp / "report.json", tmp / ("ckpt-async" if use_async else "ckpt-sync")
    out.unlink(missing_ok=True)
    torchrun(4, "-m", "executor.train", "--plan", str(plan), "--steps", str(steps), "--warmup", "1", "--out",
             str(out), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
             *(["--async-checkpoint"] if use_async else []))
    return RunReport.model_validate_json(out.read_text())


def _spread(times) -> str:  # noqa: ANN001
    got = sorted(times)
    return f"{got[0]:.3f}..{got[-1]:.3f}"


def _err(pred: float, meas: float) -> str:
    e = pred / meas - 1
    return f"{e:+7.1%} {'PASS' if abs(e) <= TARGET else 'MISS'}"


def compare(name: str, layout: dict, profile: ClusterProfile, steps: int, tmp: Path) -> list[tuple[float, bool]]:
    """Print one layout's rows; (relative error, inside the saves' spread) of its blocking times (sync, async)
    and async write."""
    pred = predicted(layout, profile, tmp / f"{name}.json")
    errors = []
    for mode in ("sync", "async"):
        report = measured(tmp / f"{name}.json", steps, tmp, mode == "async")
        saves = [r for r in report.checkpoints if r.mode == mode]
        later = saves[1:]
        block = statistics.median(r.blocking_s for r in later)
        write = statistics.median(r.write_s for r in later)
        p_block, p_write = pred[mode]
        print(f"    {name:<7} {mode:<5} {len(later):>2} saves {saves[0].bytes_per_rank / 2**20:6.1f} MiB "
              f"{saves[0].tensors_per_rank or 0:>3} t | blocking pred {p_block:6.3f} s meas {block:6.3f} s "
              f"[{_spread(r.blocking_s for r in later)}] {_err(p_block, block)} (first {saves[0].blocking_s:.3f} s)"
              + (f" | write pred {p_write:6.3f} s meas {write:6.3f} s [{_spread(r.write_s for r in later)}] "
                 f"{_err(p_write, write)}" if mode == "async" else ""))
        errors.append((p_block / block - 1, _inside(p_block, [r.blocking_s for r in later])))
        if mode == "async":
            errors.append((p_write / write - 1, _inside(p_write, [r.write_s for r in later])))
    return errors


def _inside(pred: float, times: list[float]) -> bool:
    """The prediction lies within the run's own spread of saves (min..max)."""
    return min(times) <= pred <= max(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="CPU ClusterProfile JSON with measured checkpoint lines "
                    "(default: measure one here, ~1 min)")
    ap.add_argument("--steps", type=int, default=7, help="steps per run, a save after each")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        profile = cpu_profile(args.profile, tmp)
        if profile.checkpoint is None:
            raise SystemExit(f"profile '{profile.name}' has no measured checkpoint lines: profile again "
                             "(autopar profile measures them)")
        c = profile.checkpoint
        print(f"checkpoint lines of profile '{profile.name}' ({c.ranks} ranks, {c.storage}):")
        for label, line in (("sync", c.sync), ("async blocking", c.async_blocking), ("async write", c.async_write)):
            print(f"    {label:<15} {line.fixed_s * 1e3:7.2f} ms + {line.per_tensor_s * 1e3:6.3f} ms/tensor + "
                  f"bytes at {line.bytes_per_s / 1e9:6.2f} GB/s")
        print(f"\n{SPEC.name}: {SPEC.num_layers} layers x {SPEC.hidden_size}, vocab {SPEC.vocab_size}, fp32 AdamW, "
              f"4 CPU ranks, a save after each of {args.steps} steps (target: within {TARGET:.0%})")
        errors = [e for name, layout in LAYOUTS.items() for e in compare(name, layout, profile, args.steps, tmp)]
    worst = max(abs(e) for e, _ in errors)
    print(f"\n{len(errors)} figures; median |error| {statistics.median(abs(e) for e, _ in errors):.1%}, worst "
          f"{worst:.1%}: {'PASS' if worst <= TARGET else 'MISS'}; within {TARGET:.0%}: "
          f"{sum(abs(e) <= TARGET for e, _ in errors)}; inside the run's own spread of saves: "
          f"{sum(inside for _, inside in errors)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
