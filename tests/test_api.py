"""The service against real databases (SQLite file and PostgreSQL): storage, API behaviour, bad input."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import inspect

from api import store
from api.app import create_app
from api.db import Database
from api.migrate import downgrade, migrate
from api.settings import Settings
from planner.reference import list_systems, measured_profiles, reference_profile
from planner.search.rules import Rule

SMALL_PLAN = {"model": {"preset": "llama3-8b"}, "training": {"seq_length": 4096, "global_batch_size": 64},
              "cluster": "dgx-h100", "num_nodes": 2}
INFEASIBLE_PLAN = {"model": {"preset": "llama3.1-405b"}, "training": {"seq_length": 8192, "global_batch_size": 64},
                   "cluster": "dgx-a100-40gb"}


@pytest.fixture
def client(database_url: str):  # noqa: ANN201
    with TestClient(create_app(Settings(database_url=database_url))) as c:
        yield c
        c.app.state.db.dispose()


def measured(name: str = "lab-a", memory_delta: int = 0) -> dict:
    prof = reference_profile("dgx-h100", 1).model_dump(mode="json")
    prof.update(name=name, kind="measured")
    prof["device"]["memory_bytes"] += memory_delta
    return prof


def run_report(plan: dict, step_s: float) -> dict:
    return {"layout": plan["layout"], "device": "cpu", "num_ranks": plan["num_gpus"], "warmup_steps": 1,
            "steps": [{"step": i, "loss": 10.0 - i, "time_s": step_s} for i in range(3)],
            "median_step_time_s": step_s, "tokens_per_s": 1000.0, "peak_memory_bytes_per_rank": [2**30, 2**31]}


# -- storage ---------------------------------------------------------------------------------------

def test_migrations_build_the_schema_from_empty_and_tear_it_down(database_url: str) -> None:
    db = Database(Settings(database_url=database_url).database_url)
    try:
        migrate(db.engine)
        tables = set(inspect(db.engine).get_table_names())
        assert {"clusters", "profiles", "plans", "runs", "alembic_version"} <= tables
        migrate(db.engine)  # idempotent
        downgrade(db.engine)
        assert set(inspect(db.engine).get_table_names()) <= {"alembic_version"}
        migrate(db.engine)
        assert "profiles" in inspect(db.engine).get_table_names()
    finally:
        db.dispose()


def test_reference_profiles_are_loaded_once(client: TestClient) -> None:
    shipped = measured_profiles()
    assert [p.device.name for p in shipped] == ["NVIDIA H200"]  # planner/data/measured/
    page = client.get("/v1/clusters", params={"limit": 500}).json()
    assert page["total"] == len(list_systems()) + len(shipped)
    assert {c["name"] for c in page["items"]} == set(list_systems()) | {p.name for p in shipped}
    kinds = {c["name"]: c["kind"] for c in page["items"]}
    assert all(kinds[s] == "reference" for s in list_systems()) and all(kinds[p.name] == "measured" for p in shipped)
    assert all(c["versions"] == 1 for c in page["items"])
    again = store.load_reference_profiles(client.app.state.db)  # a restart loads nothing new
    assert not any(created for *_, created in again)
    assert client.get("/v1/profiles").json()["total"] == len(list_systems()) + len(shipped)


def test_profiles_are_immutable_versioned_and_deduplicated_by_content(client: TestClient) -> None:
    first = client.post("/v1/profiles", json=measured())
    assert first.status_code == 201 and first.json()["created"] and first.json()["version"] == 1
    same = client.post("/v1/profiles", json={**measured(), "created_at": "2025-01-01T00:00:00Z"})
    assert same.status_code == 200 and not same.json()["created"]
    assert same.json()["id"] == first.json()["id"]  # a re-upload of the same measurement is not a version
    second = client.post("/v1/profiles", json=measured(memory_delta=1))
    assert second.status_code == 201 and second.json()["version"] == 2
    history = client.get("/v1/clusters/lab-a/profiles").json()["items"]
    assert [p["version"] for p in history] == [1, 2]
    got = client.get(f"/v1/profiles/{first.json()['id']}").json()
    assert got["profile"]["device"]["memory_bytes"] == measured()["device"]["memory_bytes"]  # version 1 unchanged
    assert client.get("/v1/profiles", params={"cluster": "lab-a"}).json()["total"] == 2


def test_migration_0002_rehashes_rows_stored_under_the_older_rule(database_url: str) -> None:
    """A row stored by revision 0001's rule (every field hashed) is found again after the upgrade,
    so re-uploading that file is no new version."""
    import json

    from sqlalchemy import text

    from planner.contracts import ClusterProfile

    db = Database(Settings(database_url=database_url).database_url)
    try:
        downgrade(db.engine)
        migrate(db.engine, "0001")
        prof = ClusterProfile.model_validate(measured(name="lab-legacy"))
        legacy = store.canonical_hash(prof.model_dump(mode="json", exclude={"created_at"}))
        assert legacy != store.profile_hash(prof)
        with db.engine.begin() as conn:
            cid = conn.execute(text("INSERT INTO clusters (name, created_at) VALUES ('lab-legacy', :t) RETURNING id"),
                               {"t": prof.created_at}).scalar_one()
            conn.execute(text(
                "INSERT INTO profiles (cluster_id, version, content_hash, kind, gpu_name, gpus_per_node, num_nodes, "
                "measured_at, uploaded_at, body) VALUES (:c, 1, :h, 'measured', 'x', 8, 1, :t, :t, :b)"),
                {"c": cid, "h": legacy, "t": prof.created_at, "b": json.dumps(prof.model_dump(mode="json"))})
        migrate(db.engine)
        uploaded = store.upload_profile(db, profile=prof)
        row, created = uploaded.entry.profile, uploaded.created
        assert not created and row.version == 1 and row.content_hash == store.profile_hash(prof)
    finally:
        downgrade(db.engine)
        db.dispose()


def test_concurrent_uploads_give_gapless_versions_and_no_duplicates(client: TestClient) -> None:
    db = client.app.state.db
    from planner.contracts import ClusterProfile

    bodies = [ClusterProfile.model_validate(measured("race", memory_delta=i % 6)) for i in range(24)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: store.upload_profile(db, profile=p), bodies))
    created = {u.entry.profile.id for u in results if u.created}
    assert len(created) == 6  # six distinct contents, each uploaded four times
    ids_by_delta: dict[int, set[int]] = {}
    for i, u in enumerate(results):
        ids_by_delta.setdefault(i % 6, set()).add(u.entry.profile.id)
    assert all(len(ids) == 1 for ids in ids_by_delta.values())
    versions = sorted(row.version for row, _ in store.cluster_history(db, name="race"))
    assert versions == [1, 2, 3, 4, 5, 6]


def test_profile_list_filters_and_pagination(client: TestClient) -> None:
    client.post("/v1/profiles", json=measured("lab-b"))
    page = client.get("/v1/profiles", params={"kind": "measured"}).json()
    assert {p["cluster"] for p in page["items"]} == {"lab-b", *(p.name for p in measured_profiles())}
    h100 = client.get("/v1/profiles", params={"gpu": "H100"}).json()
    assert h100["total"] >= 2 and all("h100" in p["gpu_name"].lower() for p in h100["items"])
    everything = client.get("/v1/profiles", params={"limit": 500}).json()
    pages = [client.get("/v1/profiles", params={"limit": 3, "offset": o}).json()
             for o in range(0, everything["total"], 3)]
    assert [p["id"] for pg in pages for p in pg["items"]] == [p["id"] for p in everything["items"]]
    assert client.get("/v1/profiles", params={"since": "2999-01-01T00:00:00Z"}).json()["total"] == 0
    assert client.get("/v1/profiles", params={"until": "2000-01-01T00:00:00+02:00"}).json()["total"] == 0
    assert client.get("/v1/clusters", params={"kind": "measured"}).json()["items"][0]["name"] == "lab-b"


# -- plans and runs --------------------------------------------------------------------------------

def test_plan_is_searched_stored_and_listed(client: TestClient) -> None:
    r = client.post("/v1/plans", json={**SMALL_PLAN, "options": {"top_k": 3}})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["status"] == "ok" and body["num_gpus"] == 16 and body["cluster"] == "dgx-h100"
    assert body["plan"]["prediction"]["step_time_s"] == pytest.approx(body["step_time_s"])
    assert body["plan"]["search"]["candidates_considered"] > 0 and body["plan"]["solver_status"]
    assert 1 <= len(body["plan"]["alternatives"])
    got = client.get(f"/v1/plans/{body['id']}").json()
    assert got["plan"] == body["plan"]
    again = client.post("/v1/plans", json={**SMALL_PLAN, "options": {"top_k": 3}}).json()
    assert again["reused"] and again["id"] != body["id"] and again["plan"] == body["plan"]
    listed = client.get("/v1/plans", params={"model": "llama3"}).json()
    assert listed["total"] == 2


def test_plan_options_restrict_the_search(client: TestClient) -> None:
    free = client.post("/v1/plans", json={**SMALL_PLAN, "num_nodes": 1, "training": {"seq_length": 4096,
                                                                                        "global_batch_size": 8},
                                          "options": {"max_tp": 1, "max_pp": 1, "max_cp": 1, "zero_stages": [3],
                                                      "offload": False}}).json()
    lay = free["plan"]["layout"]
    assert (lay["tp"], lay["pp"], lay["cp"], lay["zero_stage"]) == (1, 1, 1, 3) and not lay["offload_optimizer"]
    assert Rule.MAX_PP.message(limit=1) in free["plan"]["search"]["removed_by_rule"]


def test_memory_headroom_keeps_memory_free(client: TestClient) -> None:
    plain = client.post("/v1/plans", json={**SMALL_PLAN, "options": {"top_k": 1}}).json()
    tight = client.post("/v1/plans", json={**SMALL_PLAN, "options": {"top_k": 1, "memory_headroom": 0.5}}).json()
    cap = 80 * 2**30
    m, p = tight["plan"]["prediction"]["memory"], plain["plan"]["prediction"]["memory"]
    assert m["headroom_bytes"] == int(0.5 * cap) and m["total_bytes"] <= 0.5 * cap
    assert p["headroom_bytes"] == int(0.05 * cap)  # the profile's default: 5% kept free
    assert p["total_bytes"] > 0.5 * cap  # the headroom changed the answer


def test_compile_is_planned_for_torchtitan_and_explained_elsewhere(client: TestClient) -> None:
    ok = client.post("/v1/plans", json={**SMALL_PLAN, "options": {"top_k": 1, "target": "torchtitan",
                                                                    "compile": True}}).json()
    assert ok["plan"]["layout"]["compile"] is True, ok
    refused = client.post("/v1/plans", json={**SMALL_PLAN, "options": {"top_k": 1, "compile": True}}).json()
    assert refused["explanation"]["field"] == "layout.compile", refused


def test_infeasible_request_is_stored_with_an_explanation(client: TestClient) -> None:
    r = client.post("/v1/plans", json=INFEASIBLE_PLAN)
    assert r.status_code == 201
    body = r.json()
    assert body["status"] == "infeasible" and body["plan"] is None
    exp = body["explanation"]
    assert exp["field"] and exp["fix"] and "GiB" in exp["message"]
    assert client.get("/v1/plans", params={"status": "infeasible"}).json()["total"] == 1


def test_plan_from_a_hugging_face_config_and_from_a_spec(client: TestClient) -> None:
    client.post("/v1/plans", json=SMALL_PLAN)
    hf = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8,
          "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096}
    r = client.post("/v1/plans", json={**SMALL_PLAN, "model": {"hf_config": hf, "name": "tiny-llama"}})
    assert r.status_code == 201 and r.json()["model_name"] == "tiny-llama"
    spec = client.get("/v1/presets/llama3-8b").json()["spec"]
    r2 = client.post("/v1/plans", json={**SMALL_PLAN, "model": {"spec": spec}})
    assert r2.status_code == 201 and r2.json()["reused"]  # the preset written out is the same request
    bad = client.post("/v1/plans", json={**SMALL_PLAN, "model": {"hf_config": {"model_type": "bert"}}})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:3] == ["body", "model", "hf_config"]


def test_runs_show_prediction_beside_measurement_and_the_error_summary(client: TestClient) -> None:
    plan = client.post("/v1/plans", json=SMALL_PLAN).json()
    predicted = plan["step_time_s"]
    for factor in (1.25, 0.8, 1.0):
        r = client.post("/v1/runs",
                        json={"plan_id": plan["id"], "report": run_report(plan["plan"], predicted * factor)})
        assert r.status_code == 201, r.text
    run = client.get(f"/v1/runs/{r.json()['id']}").json()
    assert run["predicted_step_s"] == pytest.approx(predicted) and run["measured_step_s"] == pytest.approx(predicted)
    assert run["predicted_peak_memory_bytes"] == plan["plan"]["prediction"]["memory"]["total_bytes"]
    assert run["measured_peak_memory_bytes"] == 2**31
    summary = client.get("/v1/runs/summary").json()
    assert summary["runs"] == 3
    assert summary["median_abs_error"] == pytest.approx(0.2)  # |1/1.25-1| = 0.2, |1/0.8-1| = 0.25, 0
    assert summary["max_abs_error"] == pytest.approx(0.25)
    assert client.get("/v1/runs", params={"plan_id": plan["id"]}).json()["total"] == 3


def test_run_for_a_different_mesh_or_an_infeasible_plan_is_refused(client: TestClient) -> None:
    plan = client.post("/v1/plans", json=SMALL_PLAN).json()
    report = run_report(plan["plan"], 1.0)
    report["layout"] = {**report["layout"], "tp": report["layout"]["tp"] * 2, "sp": False,
                        "dp_shard": max(1, report["layout"]["dp_shard"] // 2)}
    r = client.post("/v1/runs", json={"plan_id": plan["id"], "report": report})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "report", "layout"]
    bad = client.post("/v1/plans", json=INFEASIBLE_PLAN).json()
    r = client.post("/v1/runs", json={"plan_id": bad["id"], "report": run_report(plan["plan"], 1.0)})
    assert r.status_code == 422 and "infeasible" in r.json()["detail"][0]["msg"]
    assert client.post("/v1/runs", json={"plan_id": 10**6, "report": run_report(plan["plan"], 1.0)}).status_code == 404


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, loc", [
    ({**SMALL_PLAN, "training": {"seq_length": 0, "global_batch_size": 8}}, ["body", "training", "seq_length"]),
    ({**SMALL_PLAN, "model": {"preset": "llama3-8b", "spec": None, "hf_config": {}}}, ["body", "model"]),
    ({**SMALL_PLAN, "model": {"preset": "gpt-99"}}, ["body", "model", "preset"]),
    ({**SMALL_PLAN, "cluster": "no-such-cluster"}, ["body", "cluster"]),
    ({**SMALL_PLAN, "cluster": None, "profile_id": 999999}, ["body", "profile_id"]),
    ({**SMALL_PLAN, "options": {"zero_stages": [4]}}, ["body", "options"]),
    ({**SMALL_PLAN, "options": {"time_budget_s": 1e9}}, ["body", "options", "time_budget_s"]),
    ({**SMALL_PLAN, "surprise": 1}, ["body", "surprise"]),
])
def test_malformed_plan_requests_get_422_with_the_field_path(client: TestClient, body: dict, loc: list) -> None:
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 422, r.text
    assert any(d["loc"][:len(loc)] == loc for d in r.json()["detail"]), r.json()
    assert "Traceback" not in r.text


def test_measured_profile_cannot_be_resized_and_bad_profiles_name_the_field(client: TestClient) -> None:
    pid = client.post("/v1/profiles", json=measured("lab-c")).json()["id"]
    r = client.post("/v1/plans", json={**SMALL_PLAN, "cluster": None, "profile_id": pid, "num_nodes": 4})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "num_nodes"]
    prof = measured("lab-d")
    prof["device"]["memory_bytes"] = -5
    r = client.post("/v1/profiles", json=prof)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-2:] == ["device", "memory_bytes"]
    for field, value in (("num_nodes", 2**40), ("gpus_per_node", 2**31)):  # absurd: 422, not a database overflow
        r = client.post("/v1/profiles", json={**measured("lab-e"), field: value})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == field
    prof = measured("lab-d")
    prof["num_nodes"] = 4
    prof["links"] = [link for link in prof["links"] if link["level"] != "inter_node"]
    r = client.post("/v1/profiles", json=prof)
    assert r.status_code == 422 and "inter_node" in r.text


def test_unknown_ids_are_404_and_huge_ids_are_422(client: TestClient) -> None:
    for path in ("/v1/plans/123456", "/v1/profiles/123456", "/v1/runs/123456", "/v1/clusters/nope/profiles",
                 "/v1/presets/nope"):
        r = client.get(path)
        assert r.status_code == 404 and "not found" in r.json()["detail"], path
    assert client.get(f"/v1/plans/{2**31}").status_code == 422


def test_auth_says_writes_are_open_without_tokens(client: TestClient) -> None:
    assert client.get("/v1/auth").json() == {"writes": "open"}
    assert client.get("/v1/auth", headers={"Authorization": "Bearer anything"}).json() == {"writes": "open"}


def test_write_endpoints_need_a_token_when_tokens_are_configured(database_url: str) -> None:
    settings = Settings(database_url=database_url, tokens=("s3cret", "other"))
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/plans", json=SMALL_PLAN).status_code == 401
        assert c.post("/v1/plans", json=SMALL_PLAN, headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert c.post("/v1/profiles", json=measured()).status_code == 401
        # GET /v1/auth answers as a POST would, so uploaders ask before their measuring
        assert c.get("/v1/auth").status_code == 401
        assert c.get("/v1/auth", headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert c.get("/v1/auth", headers={"Authorization": "Bearer s3cret"}).json() == {"writes": "token accepted"}
        ok = c.post("/v1/plans", json=SMALL_PLAN, headers={"Authorization": "Bearer other"})
        assert ok.status_code == 201
        assert c.get(f"/v1/plans/{ok.json()['id']}").status_code == 200  # reads stay open
        assert c.get("/v1/plans").json()["total"] == 1  # the refused writes stored nothing
        c.app.state.db.dispose()


def test_body_size_limit_and_cors_off_by_default(tmp_path) -> None:  # noqa: ANN001
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'x.db'}", max_body_bytes=4096, load_reference=False)
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/profiles", json=measured())  # a profile is ~5 KB
        assert r.status_code == 413 and "AUTOPAR_MAX_BODY_BYTES" in r.json()["detail"]

        def chunks():  # noqa: ANN202 - no Content-Length: counted while streaming
            for _ in range(10):
                yield b" " * 1000

        r = c.post("/v1/plans", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        r = c.get("/v1/presets", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
    cors = Settings(database_url=f"sqlite:///{tmp_path / 'y.db'}", cors_origins=("https://ok.example",),
                    load_reference=False)
    with TestClient(create_app(cors)) as c:
        r = c.get("/v1/presets", headers={"Origin": "https://ok.example"})
        assert r.headers["access-control-allow-origin"] == "https://ok.example"


def test_a_server_error_shows_no_stack_trace(tmp_path) -> None:  # noqa: ANN001
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'x.db'}", load_reference=False))

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret internal detail")

    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/boom")
        assert r.status_code == 500
        assert "secret" not in r.text and "Traceback" not in r.text and "internal error" in r.json()["detail"]


def test_health_and_readiness(tmp_path) -> None:  # noqa: ANN001
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'x.db'}", load_reference=False))) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").json()["status"] == "ready"
        c.app.state.db.engine.dispose()
        (tmp_path / "x.db").unlink()
        (tmp_path / "x.db").mkdir()  # the database file is gone and cannot be recreated
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["status"] == "database unreachable"


def test_settings_from_environment_name_the_bad_variable() -> None:
    from planner.errors import AutoparError

    s = Settings.from_env({"DATABASE_URL": "postgresql://u@h/db", "AUTOPAR_TOKENS": " a, b ,"})
    assert s.database_url == "postgresql+psycopg://u@h/db" and s.tokens == ("a", "b")
    with pytest.raises(AutoparError, match="AUTOPAR_MAX_BODY_BYTES"):
        Settings.from_env({"AUTOPAR_MAX_BODY_BYTES": "lots"})
    with pytest.raises(AutoparError, match="DATABASE_URL"):
        Settings.from_env({"DATABASE_URL": "mysql://x"})


def test_nul_characters_are_refused_not_stored(client: TestClient) -> None:
    assert client.get("/v1/profiles", params={"gpu": "h\x00100"}).status_code == 422
    r = client.post("/v1/profiles", json=measured("bad\x00name"))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "name"]
    spec = client.get("/v1/presets/llama3-8b").json()["spec"]
    r = client.post("/v1/plans", json={**SMALL_PLAN, "model": {"spec": {**spec, "name": "x\x00"}}})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "model", "name"]
