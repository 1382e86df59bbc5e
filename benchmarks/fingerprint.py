#!/usr/bin/env python3
"""Fingerprints of what the planner answers, to show a refactor changed no behaviour.

    python benchmarks/fingerprint.py             # print one SHA-256 per item, then one over them all
    python benchmarks/fingerprint.py --verbose   # also the plans' layouts

Items: the plan (best layout, its prediction, the ranked alternatives; not the search's wall time)
of each job of ``benchmarks/search.py``'s fast section, under its target and under each of the four
targets for the two smallest jobs, with the files ``autopar export`` writes for it (framework targets);
and the whole output of ``autopar validate`` on the packaged published runs. Run it on the commit before a
refactor and after it: equal lines mean the same plans, launch files and validation, to the last digit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from search import fast_jobs  # noqa: E402  (benchmarks/search.py)

from planner.contracts import Plan, TrainingConfig  # noqa: E402
from planner.export import TARGETS as EXPORT_TARGETS  # noqa: E402
from planner.export import export_plan  # noqa: E402
from planner.presets import get_preset  # noqa: E402
from planner.reference import reference_profile  # noqa: E402
from planner.search import SearchOptions, search  # noqa: E402

TARGETS = ("autopar", "megatron", "deepspeed", "torchtitan")
VOLATILE = ("wall_s",)  # the search's wall time: a timing, not an answer (its report's counts are kept)


def _strip(doc: object) -> object:
    if isinstance(doc, dict):
        return {k: _strip(v) for k, v in doc.items() if k not in VOLATILE}
    if isinstance(doc, list):
        return [_strip(v) for v in doc]
    return doc


def plan_digest(plan: Plan) -> str:
    """The plan's answers, and the launch files of a framework target."""
    doc = _strip(json.loads(plan.model_dump_json()))
    if plan.target in EXPORT_TARGETS:
        doc = {"plan": doc, "export": export_plan(plan, plan.target)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def plan_items(verbose: bool) -> list[tuple[str, str]]:
    out = []
    jobs = fast_jobs()
    runs = [(job, job.target) for job in jobs] + [(job, t) for job in jobs[1:3] for t in TARGETS if t != job.target]
    for job, target in runs:
        model = get_preset(job.preset)
        training = TrainingConfig(seq_length=job.seq, global_batch_size=job.batch)
        try:
            plan = search(model, training, reference_profile(job.system, job.nodes), SearchOptions(target=target))
            digest = plan_digest(plan)
            if verbose:
                print(f"   {job.preset} {target}: {plan.layout.model_dump_json(exclude_defaults=True)}")
        except Exception as exc:  # noqa: BLE001 - a refusal is an answer too: fingerprint its text
            digest = hashlib.sha256(f"{type(exc).__name__}: {exc}".encode()).hexdigest()[:16]
        out.append((f"plan {job.preset} --target {target}", digest))
    return out


def validate_item() -> tuple[str, str]:
    cli = subprocess.run([sys.executable, "-m", "planner.cli", "validate", "planner/data/published_runs.csv"],
                         cwd=REPO, capture_output=True, text=True, check=False)
    return "autopar validate planner/data/published_runs.csv", hashlib.sha256(
        (cli.stdout + cli.stderr + str(cli.returncode)).encode()).hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verbose", action="store_true", help="print each plan's layout")
    args = parser.parse_args()
    items = plan_items(args.verbose) + [validate_item()]
    for name, digest in items:
        print(f"{digest}  {name}")
    total = hashlib.sha256("".join(d for _, d in items).encode()).hexdigest()[:16]
    print(f"{total}  ALL ({len(items)} items)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
