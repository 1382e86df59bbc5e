"""Context parallelism (executor/cp.py): load-balanced positions in one process; cp_attention under
torchrun (4 gloo ranks, tests/dist_scripts/cp_check.py) against full causal attention and its gradients."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor.cp import load_balanced_positions, shard_for_cp
from planner.errors import AutoparError

SCRIPT = Path(__file__).parent / "dist_scripts" / "cp_check.py"
TOLERANCE = 1e-5  # fp32, max abs error of outputs and gradients


@pytest.mark.parametrize(("seq", "cp"), [(16, 1), (16, 2), (32, 4), (48, 3), (64, 8)])
def test_positions_cover_every_position_once(seq: int, cp: int) -> None:
    held = torch.cat([load_balanced_positions(seq, cp, r) for r in range(cp)])
    assert held.dtype == torch.int64
    assert sorted(held.tolist()) == list(range(seq))


@pytest.mark.parametrize(("seq", "cp"), [(16, 2), (32, 4), (48, 3)])
def test_positions_are_chunks_r_and_mirror(seq: int, cp: int) -> None:
    """Rank r holds chunk r and chunk 2cp-1-r (c = seq / 2cp tokens each), ascending."""
    c = seq // (2 * cp)
    for r in range(cp):
        pos = load_balanced_positions(seq, cp, r).tolist()
        assert pos == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))


@pytest.mark.parametrize(("seq", "cp"), [(16, 2), (32, 4), (48, 3), (64, 8)])
def test_causal_work_is_balanced(seq: int, cp: int) -> None:
    """Query row at position p attends to p + 1 keys; every rank gets the same total."""
    work = [int((load_balanced_positions(seq, cp, r) + 1).sum()) for r in range(cp)]
    assert work == [seq * (seq + 1) // (2 * cp)] * cp
    # the naive contiguous split would be unbalanced: the last rank does (2cp - 1)x the first's work
    naive = [sum(range(r * seq // cp + 1, (r + 1) * seq // cp + 1)) for r in range(cp)]
    assert len(set(naive)) == cp


@pytest.mark.parametrize("seq", [30, 12, 0])
def test_bad_seq_length_is_refused(seq: int) -> None:
    with pytest.raises(AutoparError) as info:
        load_balanced_positions(seq, 4, 0)
    msg = str(info.value)
    assert f"training.seq_length={seq}" in msg and "multiple of 2 x cp = 8" in msg


def test_bad_rank_and_size_are_refused() -> None:
    with pytest.raises(AutoparError, match=r"cp_rank=2 .*0\.\.1"):
        load_balanced_positions(16, 2, 2)
    with pytest.raises(AutoparError, match=r"layout\.cp=0 "):
        load_balanced_positions(16, 0, 0)


def test_shard_for_cp_takes_the_rank_rows_of_any_dim() -> None:
    tokens = torch.arange(2 * 16).view(2, 16)
    shards = [shard_for_cp(tokens, 1, 4, r) for r in range(4)]
    assert shards[1].tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]
    restored = torch.empty_like(tokens)
    for r, shard in enumerate(shards):
        restored[:, load_balanced_positions(16, 4, r)] = shard
    assert torch.equal(restored, tokens)
    q = torch.randn(2, 3, 8, 4)
    assert torch.equal(shard_for_cp(q, 2, 2, 1), q[:, :, [2, 3, 4, 5]])
    with pytest.raises(AutoparError, match=r"training\.seq_length=8"):
        shard_for_cp(q, 2, 3, 0)


def _load_script() -> dict:
    spec = importlib.util.spec_from_file_location("cp_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cp_attention_matches_full_causal_attention_under_torchrun(tmp_path: Path) -> None:
    """4 gloo ranks; cp=4 and cp=2 groups (strided and contiguous), GQA and MHA: local outputs and local
    q/k/v gradients equal the full causal SDPA's rows at the rank's positions (< 1e-5), while plain
    local causal attention (the negative control) is far off."""
    script = _load_script()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(SCRIPT), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    for case, (groups, hq, _) in script.CASES.items():
        results = [json.loads((tmp_path / case / f"rank{r}.json").read_text()) for r in range(4)]
        for res in results:
            group = next(g for g in groups if res["rank"] in g)
            assert res["group"] == group and res["cp"] == len(group)
            assert res["cp_rank"] == group.index(res["rank"])
            assert res["out_shape"] == [script.BATCH, hq, script.SEQ // len(group), script.HEAD_DIM]
            for name, err in res["max_abs_err"].items():
                assert err < TOLERANCE, f"{case} rank {res['rank']}: {name} max abs error {err}"
            assert res["no_cp_out_err"] > 0.1, f"{case}: local causal attention should differ from CP"
        for group in groups:  # the ranks of a group hold the whole sequence between them
            held = sorted(p for res in results if res["rank"] in group for p in res["positions"])
            assert held == list(range(script.SEQ))

    for r in range(4):
        errors = json.loads((tmp_path / "errors" / f"rank{r}.json").read_text())
        assert errors["heads"].startswith("cp_attention.k.shape[1]=3 ")
        assert errors["positions"].startswith("cp_attention.positions.shape=(6,) ")
        assert errors["not_4d"].startswith("cp_attention.q.shape=(4, 8, 16) ")
        assert errors["seq_length"].startswith("training.seq_length=30 ")
