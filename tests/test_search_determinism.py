"""The search's answer does not depend on Python's string-hash seed (set iteration order): the same job
gives byte-identical plans (the wall time aside) under two ``PYTHONHASHSEED`` values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = """
import json, sys
from planner.contracts import TrainingConfig
from planner.presets import get_preset
from planner.reference import reference_profile
from planner.search import SearchOptions, search
model, system, nodes, seq, batch, target = sys.argv[1:]
plan = search(get_preset(model), TrainingConfig(seq_length=int(seq), global_batch_size=int(batch)),
              reference_profile(system, num_nodes=int(nodes)), SearchOptions(target=target))
doc = plan.model_dump(mode="json")
doc["search"]["wall_s"] = 0.0
print(json.dumps(doc, sort_keys=True))
"""


def _plan(seed: str, *job: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, *job], capture_output=True, text=True, env=env,
                         timeout=300, check=True, cwd=REPO)
    return json.loads(out.stdout)


@pytest.mark.parametrize("job", [("gpt3-175b", "dgx-a100-80gb", "128", "2048", "1536", "megatron"),
                                 ("mixtral-8x7b", "dgx-h100", "8", "4096", "256", "torchtitan")])
def test_plans_do_not_depend_on_the_hash_seed(job):
    first, second = _plan("1", *job), _plan("2", *job)
    assert first == second
