"""Any GPU count and a global batch range (planner.search.sizing): which pairs are searched, the choice, and
its record in the CLI, the API and the plan page."""

from __future__ import annotations

import pytest

from planner.contracts import TrainingConfig
from planner.contracts.plan import SizeTried
from planner.errors import AutoparError
from planner.presets import get_preset
from planner.reference import reference_profile
from planner.search import SearchOptions, search
from planner.search.sizing import batch_counts, gpu_counts, on_gpus, smooth, smooth_below, why

MODEL = get_preset("llama3-8b")


def test_smooth_counts_are_products_of_twos_and_threes():
    assert [n for n in range(1, 26) if smooth(n)] == [1, 2, 3, 4, 6, 8, 9, 12, 16, 18, 24]
    assert sorted(smooth_below(25)) == [1, 2, 3, 4, 6, 8, 9, 12, 16, 18, 24]
    assert sorted(smooth_below(131_071))[-2:] == [118_098, 124_416]  # 2 x 3^10, 2^9 x 3^5


def test_part_of_a_node_is_cut_from_the_node():
    profile = reference_profile("dgx-h100", gpus=5)
    assert on_gpus(profile, 4).name == "dgx-h100-4gpu" and on_gpus(profile, 4).num_gpus == 4


@pytest.mark.parametrize(("nodes", "gpus", "expected"), [
    (5, None, [40, 32, 24]),     # 5 nodes: beside 4 and 3 nodes
    (4, None, [32]),             # 4 nodes: alone
    (25, None, [200, 192, 144]),  # 25 nodes: 24 and 18 nodes
    (1, 5, [5, 4, 3]),           # 5 GPUs of one node: 4 and 3 GPUs
    (1, 6, [6]),
])
def test_an_uneven_count_is_searched_beside_the_largest_smooth_counts_below_it(nodes, gpus, expected):
    profile = reference_profile("dgx-h100", nodes, gpus=gpus)
    assert gpu_counts(profile, SearchOptions()) == expected
    assert gpu_counts(profile, SearchOptions(idle_gpus=False)) == [profile.num_gpus]


@pytest.mark.parametrize(("low", "high", "expected"), [
    (1920, 2560, [2560, 2048, 1920]),  # 2048 = 2^11 lies inside
    (2000, 2040, [2040, 2016, 2000]),  # 2^5: 2016 = 63 x 32; 2^6's multiples 1984 and 2048 lie outside
    (64, 64, [64]),
    (3, 5, [5, 4, 3]),
])
def test_a_batch_range_searches_both_ends_and_its_roundest_count(low, high, expected):
    training = TrainingConfig(seq_length=4096, global_batch_size=low)
    assert batch_counts(training, SearchOptions(global_batch_max=high)) == expected


def test_when_nothing_divides_all_gpus_some_are_left_idle():
    """40 GPUs, batch 32, no pipeline or CP: dp = 40 / tp is 5, 10, 20 or 40, none divides 32; 32 GPUs run it."""
    training = TrainingConfig(seq_length=4096, global_batch_size=32)
    opts = SearchOptions(max_pp=1, max_cp=1, time_budget_s=20)
    with pytest.raises(AutoparError):
        search(MODEL, training, reference_profile("dgx-h100", 5), SearchOptions(max_pp=1, max_cp=1, idle_gpus=False))
    plan = search(MODEL, training, reference_profile("dgx-h100", 5), opts)
    assert plan.num_gpus in (32, 24) and plan.sizing.chosen_gpus == plan.num_gpus
    assert plan.sizing.available_gpus == 40
    (full,) = [t for t in plan.sizing.tried if t.num_gpus == 40]
    assert full.step_time_s is None and full.reason
    assert f"{plan.num_gpus} of 40 GPUs ({40 - plan.num_gpus} idle): no layout of all 40" in plan.sizing.why


def test_the_range_chooses_the_pair_with_the_most_tokens_per_second():
    training = TrainingConfig(seq_length=4096, global_batch_size=1920)
    plan = search(MODEL, training, reference_profile("dgx-h100", 4), SearchOptions(global_batch_max=2560))
    z = plan.sizing
    assert [t.global_batch_size for t in z.tried] == [2560, 2048, 1920] and z.global_batch_range == [1920, 2560]
    best = max(z.tried, key=lambda t: t.tokens_per_s)
    assert (z.chosen_gpus, z.chosen_global_batch) == (best.num_gpus, best.global_batch_size) == \
        (plan.num_gpus, plan.training.global_batch_size)
    for t in z.tried:  # tokens/s is the pair's batch over its step
        assert t.tokens_per_s == pytest.approx(t.global_batch_size * 4096 / t.step_time_s)
    assert plan.prediction.step_time_s == pytest.approx(best.step_time_s)


def test_why_compares_the_choice_with_the_best_of_the_others_by_hand():
    tried = [SizeTried(num_gpus=40, global_batch_size=64, step_time_s=1.0, tokens_per_s=100.0),
             SizeTried(num_gpus=32, global_batch_size=64, step_time_s=0.8, tokens_per_s=125.0),
             SizeTried(num_gpus=32, global_batch_size=48, step_time_s=0.8, tokens_per_s=100.0)]
    assert why(tried[1], tried, 40) == ("32 of 40 GPUs (8 idle) train 25.0% more tokens/s than all 40; global batch "
                                        "64, the most tokens/s of those searched (48: -20.0%)")
    assert why(tried[0], tried[:1] + tried[2:], 40) == "all 40 GPUs: 0.0% more tokens/s than the best on 32"


def test_the_cli_takes_a_range_and_prints_the_choice():
    from typer.testing import CliRunner

    from planner import cli

    runner = CliRunner()
    ok = runner.invoke(cli.app, ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2",
                                 "--global-batch", "48..64", "--top", "1"])
    assert ok.exit_code == 0, ok.output
    assert "sizing: gpus=16 of 16 global_batch=" in ok.output and "of 48..64" in ok.output
    for bad, said in [("64..48", "high end is below"), ("abc", "is not a count or a range"),
                      ("0..8", "outside 1..2^24")]:
        out = runner.invoke(cli.app, ["plan", "--model", "llama3-8b", "--global-batch", bad])
        # in-process the AutoparError itself; the console script prints it and exits 2 (cli.main)
        assert isinstance(out.exception, AutoparError) and out.exception.field == "--global-batch", out.output
        assert said in str(out.exception)
    out = runner.invoke(cli.app, ["predict", "--model", "llama3-8b", "--global-batch", "48..64"])
    assert isinstance(out.exception, AutoparError) and "a range is for autopar plan" in str(out.exception)


def test_the_api_and_the_page_carry_the_sizing(tmp_path):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    body = {"model": {"preset": "llama3-8b"}, "training": {"seq_length": 4096, "global_batch_size": 32},
            "cluster": "dgx-h100", "num_nodes": 5, "options": {"top_k": 1, "max_pp": 1, "max_cp": 1}}
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path}/x.db"))) as c:
        out = c.post("/v1/plans", json=body).json()
        assert out["status"] == "ok" and out["plan"]["sizing"]["available_gpus"] == 40
        assert out["num_gpus"] == out["plan"]["num_gpus"] < 40
        page = c.get(f"/plans/{out['id']}").text
        assert "GPUs and global batch" in page and "idle" in page
        tokens = {**body, "training": {"seq_length": 4096, "global_batch_tokens": 131072},
                  "options": {"global_batch_max": 64}}
        refused = c.post("/v1/plans", json=tokens)
        assert refused.status_code == 422 and "global_batch_max" in refused.text
        below = {**body, "options": {"global_batch_max": 16}}
        assert c.post("/v1/plans", json=below).status_code == 422
