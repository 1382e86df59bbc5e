"""The service under fire (issue 28): nonsense refused with the field, the value and the fix; wildcards that are
characters; retried writes stored once; the API docs offline; the schema the migrations build is the models'."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient
from test_api import SMALL_PLAN, client, measured, run_report  # noqa: F401  (the client fixture)

from api.app import create_app
from api.settings import Settings


def _refused(r, field: str, words: str) -> None:  # noqa: ANN001
    assert r.status_code == 422, (r.status_code, r.text[:400])
    text = r.text
    assert field in text and words in text, text[:600]


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"name": "racks/a"}, "name", "part of its address"),
    ({"name": "x" * 10_000}, "name", "10,000 characters"),
    ({"created_at": "9999-01-01T00:00:00Z"}, "created_at", "between 2000-01-01 and now"),
])
def test_implausible_profiles_are_refused_naming_the_field(client: TestClient, change: dict, field: str,  # noqa: F811
                                                           words: str) -> None:
    _refused(client.post("/v1/profiles", json={**measured(), **change}), field, words)


def test_a_link_of_1e30_bytes_per_second_and_a_multi_rank_profile_without_links_are_refused(
        client: TestClient) -> None:  # noqa: F811
    body = measured()
    body["links"][0]["busbw_bytes_per_s"] = 1e30
    _refused(client.post("/v1/profiles", json=body), "busbw_bytes_per_s", "no link moves more than")
    from planner.reference import reference_profile

    two = reference_profile("dgx-h100", 8).model_dump(mode="json")
    two.update(name="no-links", kind="measured", links=[x for x in two["links"] if x["level"] == "host_device"])
    _refused(client.post("/v1/profiles", json=two), "links", "has no links between them")


def test_a_step_of_1e12_seconds_is_refused(client: TestClient) -> None:  # noqa: F811
    plan = client.post("/v1/plans", json=SMALL_PLAN).json()
    report = run_report(plan["plan"], 1e12)
    _refused(client.post("/v1/runs", json={"plan_id": plan["id"], "report": report}), "median_step_time_s",
             "less than or equal to 604800")


def test_a_run_report_posted_twice_is_stored_once(client: TestClient) -> None:  # noqa: F811
    plan = client.post("/v1/plans", json=SMALL_PLAN).json()
    body = {"plan_id": plan["id"], "report": run_report(plan["plan"], 0.5)}
    first = client.post("/v1/runs", json=body)
    again = client.post("/v1/runs", json=body)
    assert first.status_code == 201 and first.json()["created"] is True
    assert again.status_code == 200 and again.json()["created"] is False and again.json()["id"] == first.json()["id"]
    assert client.get("/v1/runs").json()["total"] == 1 and client.get("/v1/runs/summary").json()["runs"] == 1
    other = client.post("/v1/runs", json={**body, "report": run_report(plan["plan"], 0.6)})
    assert other.status_code == 201 and client.get("/v1/runs").json()["total"] == 2


def test_an_idempotency_key_answers_a_retry_with_the_stored_plan(client: TestClient) -> None:  # noqa: F811
    key = {"Idempotency-Key": "retry-me-1"}
    first = client.post("/v1/plans", json=SMALL_PLAN, headers=key)
    again = client.post("/v1/plans", json=SMALL_PLAN, headers=key)
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"] and again.json()["reused"] is True
    assert client.get("/v1/plans").json()["total"] == 1
    other = {**SMALL_PLAN, "training": {**SMALL_PLAN["training"], "global_batch_size": 256}}
    _refused(client.post("/v1/plans", json=other, headers=key), "Idempotency-Key", "another request")
    assert client.get("/v1/plans").json()["total"] == 1
    assert client.post("/v1/plans", json=SMALL_PLAN).status_code == 201  # without a key: a plan per request
    assert client.get("/v1/plans").json()["total"] == 2


def test_wildcards_are_characters_and_an_empty_range_says_so(client: TestClient) -> None:  # noqa: F811
    assert client.get("/v1/profiles", params={"gpu": "%"}).json()["total"] == 0
    assert client.get("/v1/profiles", params={"gpu": "_"}).json()["total"] == 0
    assert client.get("/v1/clusters", params={"gpu": "%"}).json()["total"] == 0
    assert client.get("/v1/plans", params={"model": "%"}).json()["total"] == 0
    assert client.get("/v1/profiles", params={"gpu": "h100"}).json()["total"] > 0
    r = client.get("/v1/profiles", params={"since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"})
    _refused(r, "since", "is after until")


def test_the_api_docs_load_nothing_from_outside(tmp_path) -> None:  # noqa: ANN001
    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'd.db'}", load_reference=False))) as c:
        page = c.get("/docs")
        assert page.status_code == 200
        urls = re.findall(r"""(?:src|href)=["']([^"']+)|url:\s*["']([^"']+)""", page.text)
        found = [u for pair in urls for u in pair if u]
        assert found and not [u for u in found if re.match(r"(https?:)?//", u)], found
        for url in found:
            assert c.get(url).status_code == 200, url
        assert c.get("/redoc").status_code == 404


def test_the_migrations_build_the_models_schema(tmp_path) -> None:  # noqa: ANN001
    """Alembic's comparison of the migrated database with api/db.py's models finds nothing to add or drop."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from api.db import Base, Database
    from api.migrate import migrate

    db = Database(f"sqlite:///{tmp_path / 'm.db'}")
    try:
        migrate(db.engine)
        with db.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        assert diff == [], diff
    finally:
        db.dispose()


def test_search_slots_queue_a_bounded_number_and_refuse_the_rest() -> None:
    import threading
    import time

    from api.slots import Saturated, SearchSlots

    slots = SearchSlots(workers=1, queue=1, wait_s=5.0)
    held, waited = threading.Event(), []
    release = threading.Event()

    def hold() -> None:
        with slots.slot():
            held.set()
            release.wait(10)

    def wait() -> None:
        with slots.slot():
            waited.append(time.perf_counter())

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)
    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + 5
    while slots.waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.perf_counter()
    with pytest.raises(Saturated) as full, slots.slot():
        pass
    assert time.perf_counter() - t0 < 0.5  # refused at once, not after a wait
    assert full.value.running == 1 and full.value.waiting == 1 and full.value.retry_after_s >= 1
    release.set()
    holder.join(5)
    waiter.join(5)
    assert len(waited) == 1 and slots.running == 0 and slots.waiting == 0
    # a waiter gives up after wait_s
    short = SearchSlots(workers=1, queue=1, wait_s=0.2)
    with short.slot(), pytest.raises(Saturated), short.slot():
        pass


def test_a_saturated_service_answers_503_with_retry_after(tmp_path) -> None:  # noqa: ANN001
    settings = Settings(database_url=f"sqlite:///{tmp_path / 's.db'}", plan_workers=1, plan_queue=0)
    with TestClient(create_app(settings)) as c, c.app.state.plan_slots.slot():  # the one slot is busy
        r = c.post("/v1/plans", json=SMALL_PLAN)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
        assert "saturated" in r.json()["detail"]
        assert c.get("/v1/plans").json()["total"] == 0
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/plans", json=SMALL_PLAN).status_code == 201


def test_a_write_without_a_token_hears_401_whatever_its_body(tmp_path) -> None:  # noqa: ANN001
    settings = Settings(database_url=f"sqlite:///{tmp_path / 't.db'}", load_reference=False, tokens=("s3cret",))
    bad = {"content": b"{not json", "headers": {"content-type": "application/json"}}
    with TestClient(create_app(settings)) as c:
        for path in ("/v1/plans", "/v1/runs", "/v1/profiles"):
            assert c.post(path, **bad).status_code == 401, path
        ok = {**bad["headers"], "Authorization": "Bearer s3cret"}
        assert c.post("/v1/plans", content=bad["content"], headers=ok).status_code == 422


@pytest.mark.parametrize(("where", "value", "field"), [
    (("device", "peak_tflops", "bf16"), 1e9, "peak_tflops"),
    (("device", "hbm_bandwidth_bytes_per_s"), 1e20, "hbm_bandwidth_bytes_per_s"),
    (("links", 0, "alpha_s"), 1e6, "alpha_s"),
])
def test_implausible_device_and_link_figures_are_refused(client: TestClient, where: tuple, value: float,  # noqa: F811
                                                         field: str) -> None:
    body = measured()
    node = body
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    _refused(client.post("/v1/profiles", json=body), field, "less than or equal to")


def test_a_run_of_impossible_figures_is_refused(client: TestClient) -> None:  # noqa: F811
    plan = client.post("/v1/plans", json=SMALL_PLAN).json()
    report = run_report(plan["plan"], 0.5)
    for change, field in (({"tokens_per_s": 1e15}, "tokens_per_s"),
                          ({"peak_memory_bytes_per_rank": [2**60]}, "peak_memory_bytes_per_rank"),
                          ({"created_at": "1970-01-01T00:00:00Z"}, "created_at")):
        _refused(client.post("/v1/runs", json={"plan_id": plan["id"], "report": {**report, **change}}), field, "")
