"""Requests that used to hang or crash: sizes beyond any real job, NaN and Infinity in request bodies,
``true`` for a count, and search phases the time budget did not cover. Each is refused at once with
the field, the value and the fix, or stops at its budget."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from planner.contracts import ClusterProfile, ModelSpec, MoESpec, ParallelLayout, TrainingConfig
from planner.contracts.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_SEQ
from planner.errors import AutoparError
from planner.reference import reference_profile
from planner.search import SearchOptions, search
from planner.search.enumerate import divisors

ROOT = Path(__file__).resolve().parents[1]
HUGE = 10**30
TRAINING = {"seq_length": 4096, "global_batch_size": 64}
SPEC = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "vocab_size": 256}
MOE = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 64}


def _refused(make, field: str) -> str:  # noqa: ANN001
    with pytest.raises(ValidationError) as info:
        make()
    text = str(info.value)
    assert field in text, text
    return text


# -- sizes: every one a user gives has an upper bound ----------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("seq_length", HUGE), ("global_batch_size", HUGE), ("global_batch_size", MAX_GLOBAL_BATCH + 1),
    ("global_batch_tokens", HUGE),
])
def test_training_sizes_are_bounded(field: str, value: int) -> None:
    body = {**TRAINING, "global_batch_size": None, field: value} if field == "global_batch_tokens" else \
        {**TRAINING, field: value}
    _refused(lambda: TrainingConfig(**body), field)


def test_a_token_batch_of_more_sequences_than_the_bound_is_refused() -> None:
    # 2^30 tokens of 16-token sequences: 2^26 sequences, each count within its own bound
    text = _refused(lambda: TrainingConfig(seq_length=16, global_batch_tokens=2**30), "global_batch_tokens")
    assert "67,108,864 sequences" in text and f"{MAX_GLOBAL_BATCH:,}" in text


@pytest.mark.parametrize("field", ["num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                   "vocab_size", "num_kv_heads", "head_dim", "max_position_embeddings"])
def test_model_sizes_are_bounded(field: str) -> None:
    _refused(lambda: ModelSpec(**{**SPEC, field: HUGE}), field)


@pytest.mark.parametrize("field", ["num_experts", "top_k", "expert_ffn_hidden_size", "num_shared_experts",
                                   "shared_expert_ffn_hidden_size", "first_dense_layers", "layer_frequency",
                                   "capacity_factor"])
def test_moe_sizes_are_bounded(field: str) -> None:
    _refused(lambda: MoESpec(**{**MOE, field: HUGE}), field)


def test_a_learned_position_table_as_long_as_the_longest_sequence_is_allowed() -> None:
    spec = ModelSpec(**SPEC, position_embedding="learned", max_position_embeddings=MAX_SEQ)
    assert spec.max_position_embeddings == MAX_SEQ  # was capped at the hidden-size bound (262,144)


def test_cluster_and_layout_sizes_are_bounded() -> None:
    prof = reference_profile("dgx-h100", 1)
    body = prof.model_dump()
    _refused(lambda: ClusterProfile.model_validate({**body, "num_nodes": HUGE}), "num_nodes")
    text = _refused(lambda: prof.with_nodes(MAX_GPUS // 8 + 1), "num_nodes")
    assert f"use at most {MAX_GPUS // 8:,} nodes" in text
    _refused(lambda: ClusterProfile.model_validate({**body, "device": {**body["device"], "memory_bytes": HUGE}}),
             "memory_bytes")
    for field in ("tp", "pp", "cp", "ep", "dp_shard", "dp_replicate", "micro_batch_size", "virtual_stages"):
        _refused(lambda field=field: ParallelLayout(**{field: HUGE}), field)


# -- strict types: true is no count ------------------------------------------------------------------

@pytest.mark.parametrize(("make", "field"), [
    (lambda: TrainingConfig(**{**TRAINING, "seq_length": True}), "seq_length"),
    (lambda: TrainingConfig.model_validate_json('{"seq_length": true, "global_batch_size": 64}'), "seq_length"),
    (lambda: TrainingConfig(**{**TRAINING, "global_batch_size": True}), "global_batch_size"),
    (lambda: TrainingConfig(**{**TRAINING, "moe_load_imbalance": True}), "moe_load_imbalance"),
    (lambda: ModelSpec(**{**SPEC, "num_layers": True}), "num_layers"),
    (lambda: MoESpec(**{**MOE, "capacity_factor": True}), "capacity_factor"),
    (lambda: MoESpec(**{**MOE, "top_k": True}), "top_k"),
    (lambda: ParallelLayout(tp=True), "tp"),
    (lambda: ParallelLayout(zero_stage=True), "zero_stage"),
    (lambda: ParallelLayout(pp=2, layers_per_stage=[True, 1]), "layers_per_stage"),
    (lambda: ClusterProfile.model_validate({**reference_profile("dgx-h100", 1).model_dump(), "gpus_per_node": True}),
     "gpus_per_node"),
])
def test_true_is_not_a_count(make, field: str) -> None:  # noqa: ANN001
    text = _refused(make, field)
    assert "input_value=True" in text, text


def test_counts_given_as_json_integers_are_still_read() -> None:
    tr = TrainingConfig.model_validate_json('{"seq_length": 4096, "global_batch_size": 64, "moe_load_imbalance": 2}')
    assert (tr.seq_length, tr.global_batch_size, tr.moe_load_imbalance) == (4096, 64, 2.0)


# -- divisors and the search's time budget -----------------------------------------------------------

def test_divisors_are_every_divisor_in_order() -> None:
    def by_division(n: int) -> list[int]:
        return [d for d in range(1, n + 1) if n % d == 0]

    rng = random.Random(0)
    for n in [*range(1, 600), *(rng.randrange(1, 20_000) for _ in range(200)), 720_720, 2**20]:
        assert divisors(n) == by_division(n), n
    assert divisors(2**24) == [2**i for i in range(25)]
    assert divisors(16_777_213) == [1, 16_777_213]  # the largest prime below 2^24


def test_divisors_refuse_a_count_beyond_every_bound_at_once() -> None:
    # the old trial division ran to √n: for the Mersenne prime 2^61 - 1, 1.5e9 steps
    code = ("from planner.search.enumerate import divisors\ntry:\n    divisors(2**61 - 1)\n"
            "except ValueError as e:\n    print(e)")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert "outside 1.." in r.stdout and time.perf_counter() - t0 < 10, (r.stdout, r.stderr)


@pytest.mark.parametrize("budget", [math.nan, math.inf, 0.0, -1.0, 1e9, True])
def test_a_time_budget_the_search_cannot_keep_is_refused(budget: float) -> None:
    with pytest.raises(AutoparError) as info:
        SearchOptions(time_budget_s=budget)
    assert info.value.field == "time_budget_s" and "3600" in info.value.fix


def _timed(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, **opts) -> tuple[float, object]:  # noqa: ANN003
    t0 = time.perf_counter()
    try:
        out: object = search(model, training, profile, SearchOptions(**opts))
    except AutoparError as exc:
        out = exc
    return time.perf_counter() - t0, out


GIANT = ModelSpec(name="giant", num_layers=4096, hidden_size=65536, num_attention_heads=4096, num_kv_heads=4096,
                  ffn_hidden_size=262144, vocab_size=4_194_304,
                  moe=MoESpec(num_experts=16384, top_k=16, expert_ffn_hidden_size=65536))


def test_the_budget_covers_listing_and_bounding_the_layouts() -> None:
    """2^20 ranks in nodes of 1,024, micro-batches up to 1,024: 334,639 layouts, listed and bounded in
    ~1.7 s before the budget was first looked at."""
    prof = reference_profile("dgx-h100", 1).model_copy(update={"gpus_per_node": 1024, "num_nodes": 1024})
    tr = TrainingConfig(seq_length=MAX_SEQ, global_batch_size=MAX_GLOBAL_BATCH)
    wall, out = _timed(GIANT, tr, prof, time_budget_s=0.2, max_micro_batch_size=1024)
    assert isinstance(out, AutoparError) and out.field == "time_budget_s" and "ran out" in out.problem, out
    # 0.20 s alone; 0.79 s seen once under make test's two loaded workers: 1 s of slack still fails the
    # 1.7 s of listing the old code spent before it first looked at the budget (a guard, not a timing target)
    assert wall < 0.2 + 1.0, wall


def test_the_budget_covers_structures_whose_leaves_all_fail_to_fit() -> None:
    """Nothing fits: every leaf was refused before the only budget check (30 s of a 1 s budget)."""
    wall, out = _timed(GIANT, TrainingConfig(seq_length=2**20, global_batch_size=MAX_GLOBAL_BATCH),
                       reference_profile("dgx-h100", 1024), time_budget_s=1.0, max_micro_batch_size=1024)
    assert isinstance(out, AutoparError) and out.field == "time_budget_s" and "ran out" in out.problem, out
    # the old code took 30 s. On 2 loaded cores the budget may run out while bounding, before the leaves
    # (both seen under make test's two workers); 5 s of slack for a check between leaves (1.5-1.8 s alone,
    # 1.77 s, 2.21 s, 3.17 s and, with the V schedules, 4.71 s seen under make test's load; this guards against
    # the 30 s, not a timing target)
    assert wall < 1.0 + 5.0, (wall, str(out))


def test_the_budget_covers_the_alternatives_predictions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the budget is spent, the alternatives are listed with their search price, not predicted in full (a
    4,096-layer model's 50 predictions took 5 s after the budget). Each prediction is made to take 0.5 s, so the
    budget runs out among them however loaded the machine is (a 96-layer search finishes in well under 1 s)."""
    import planner.search.engine as engine

    def slow_predict(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(0.5)
        return real_predict(*args, **kwargs)

    real_predict = engine.predict
    monkeypatch.setattr(engine, "predict", slow_predict)
    model = ModelSpec(name="m", num_layers=96, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096,
                      vocab_size=32000)
    wall, plan = _timed(model, TrainingConfig(seq_length=2048, global_batch_size=1024),
                        reference_profile("dgx-h100", 8), time_budget_s=3.0, top_k=50)
    assert not isinstance(plan, AutoparError), plan
    assert wall < 3.0 + 2.0, wall  # one prediction past the budget, and slack for a loaded machine
    assert plan.prediction is not None and len(plan.alternatives) > 8, plan.solver_status
    skipped = [a for a in plan.alternatives if a.prediction is None]
    assert skipped and all("time budget was spent" in a.reason and a.slower_by >= 0 for a in skipped)


# -- the command line --------------------------------------------------------------------------------

def _autopar(*args: str, timeout: float = 60) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", "from planner.cli import main; main()", *args], capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT)
    return r.returncode, r.stdout + r.stderr, time.perf_counter() - t0


@pytest.mark.parametrize(("args", "flag"), [
    (("--global-batch", str(HUGE)), "--global-batch"),
    (("--global-batch-tokens", str(HUGE)), "--global-batch-tokens"),
    (("--global-batch", "64", "--seq", str(HUGE)), "--seq"),
    (("--global-batch", "64", "--nodes", str(HUGE)), "--nodes"),
    (("--global-batch", "64", "--time-budget", "inf"), "--time-budget"),
    (("--global-batch", "64", "--time-budget", "nan"), "--time-budget"),
    (("--global-batch", "64", "--max-micro-batch", str(HUGE)), "--max-micro-batch"),
])
def test_plan_flags_beyond_their_bounds_exit_2_at_once(args: tuple[str, ...], flag: str) -> None:
    """--global-batch 1e30 held a core in trial division for minutes (timeout: the old behaviour fails)."""
    code, out, wall = _autopar("plan", "--model", "llama3-8b", *args, timeout=60)
    assert code == 2 and flag in out and "Traceback" not in out, out
    assert wall < 30, wall


# -- the service: NaN and Infinity, true for a count, sizes beyond any job ----------------------------

GOOD_PLAN = {"model": {"preset": "llama3-8b"}, "training": TRAINING, "cluster": "dgx-h100",
             "options": {"time_budget_s": 5}}

BAD_BODIES = [  # (path, raw JSON body, the field the 422 names)
    ("/v1/plans", '{"model": {"preset": "llama3-8b"}, "training": {"seq_length": 4096, "global_batch_size": 64, '
                  '"moe_load_imbalance": NaN}, "cluster": "dgx-h100"}', "training.moe_load_imbalance"),
    ("/v1/plans", '{"model": {"preset": "llama3-8b"}, "training": {"seq_length": 4096, "global_batch_size": 64}, '
                  '"cluster": "dgx-h100", "options": {"time_budget_s": Infinity}}', "options.time_budget_s"),
    ("/v1/plans", '{"model": {"preset": "llama3-8b"}, "training": {"seq_length": 4096, "global_batch_size": 64}, '
                  '"cluster": "dgx-h100", "options": {"memory_headroom": -Infinity}}', "options.memory_headroom"),
    ("/v1/plans", '{"model": {"hf_config": {"model_type": "llama", "rope_theta": 1e999}}, "training": '
                  '{"seq_length": 4096, "global_batch_size": 64}, "cluster": "dgx-h100"}',
     "model.hf_config.rope_theta"),
    ("/v1/runs", '{"plan_id": 1, "report": {"steps": [{"step": 0, "loss": 1.0, "time_s": 1.0}, '
                 '{"step": 1, "loss": NaN, "time_s": 1.0}]}}', "report.steps.1.loss"),
    ("/v1/profiles", '{"name": "x", "device": {"peak_tflops": {"bf16": Infinity}}}', "device.peak_tflops.bf16"),
    ("/v1/plans", 'NaN', "body"),
]


def _is_json(text: str) -> dict:
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"the response holds {c}"))


def test_nan_and_infinity_get_422_naming_the_field_and_the_connection_survives(tmp_path: Path,
                                                                               live_server) -> None:  # noqa: ANN001
    """Before: 500 (the 422 echoed nan, which JSON cannot hold) and the next request on the same
    keep-alive connection was reset. One connection carries every request here."""
    import httpx

    with live_server(f"sqlite:///{tmp_path / 'nan.db'}") as server, \
            httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
        ports = set()
        for path, body, field in BAD_BODIES:
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 422, (path, body, r.status_code, r.text)
            detail = _is_json(r.text)["detail"][0]
            assert ".".join(str(p) for p in detail["loc"][1:]) == (field if field != "body" else ""), detail
            assert field in detail["msg"] and "finite" in detail["msg"], detail
            ports.add(r.extensions["network_stream"].get_extra_info("client_addr"))
            good = client.post("/v1/plans", json=GOOD_PLAN)
            assert good.status_code == 201, good.text
            ports.add(good.extensions["network_stream"].get_extra_info("client_addr"))
        assert len(ports) == 1, ports  # one connection, never reset
    assert "Traceback" not in server.log and "internal error" not in server.log, server.log[-3000:]


@pytest.fixture
def client(tmp_path: Path):  # noqa: ANN201
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'a.db'}"))) as c:
        yield c
        c.app.state.db.dispose()


@pytest.mark.parametrize(("change", "loc"), [
    ({"training": {"seq_length": True, "global_batch_size": 64}}, ["training", "seq_length"]),
    ({"training": {"seq_length": 4096, "global_batch_size": True}}, ["training", "global_batch_size"]),
    ({"training": {"seq_length": 4096, "global_batch_size": "64"}}, ["training", "global_batch_size"]),
    ({"num_nodes": True}, ["num_nodes"]),
    ({"options": {"top_k": True}}, ["options", "top_k"]),
    ({"options": {"max_tp": True}}, ["options", "max_tp"]),
    ({"options": {"zero_stages": [True]}}, ["options", "zero_stages", 0]),
    ({"options": {"time_budget_s": True}}, ["options", "time_budget_s"]),
    ({"model": {"spec": {**SPEC, "num_layers": True}}}, ["model", "spec", "num_layers"]),
])
def test_true_for_a_count_gets_422(client, change: dict, loc: list) -> None:  # noqa: ANN001
    r = client.post("/v1/plans", json={**GOOD_PLAN, **change})
    assert r.status_code == 422, r.text
    assert any(d["loc"][1:] == loc for d in r.json()["detail"]), r.json()


@pytest.mark.parametrize(("change", "field"), [
    ({"training": {"seq_length": 4096, "global_batch_size": HUGE}}, "global_batch_size"),
    ({"training": {"seq_length": 4096, "global_batch_tokens": HUGE}}, "global_batch_tokens"),
    ({"training": {"seq_length": HUGE, "global_batch_size": 64}}, "seq_length"),
    ({"num_nodes": HUGE}, "num_nodes"),
    ({"num_nodes": MAX_GPUS}, "num_nodes"),  # 8 GPUs a node: 8 x 2^20 devices
    ({"options": {"max_micro_batch_size": HUGE}}, "max_micro_batch_size"),
    ({"options": {"max_pp": HUGE}}, "max_pp"),
    ({"options": {"time_budget_s": 1e300}}, "time_budget_s"),
    ({"model": {"spec": {**SPEC, "vocab_size": HUGE}}}, "vocab_size"),
])
def test_sizes_beyond_any_job_get_422_at_once(client, change: dict, field: str) -> None:  # noqa: ANN001
    t0 = time.perf_counter()
    r = client.post("/v1/plans", json={**GOOD_PLAN, **change})
    assert r.status_code == 422 and field in r.text, r.text
    assert time.perf_counter() - t0 < 1.0
