"""kill -9 under write load (issue 28): every write the service acknowledged is there after a restart, whole, on
SQLite and PostgreSQL, three kills each. Writers post measured profiles (a new cluster each) and run reports
(a new report each) from threads while the server is killed with SIGKILL mid-stream; a new server on the same
database then serves every acknowledged id with the body that was sent."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from test_api import SMALL_PLAN, measured, run_report

KILLS = 3
WRITERS = 4


def _writer(url: str, plan: dict, tag: str, acked: list, stop: threading.Event) -> None:
    """Post until the server dies or ``stop``; record each acknowledged (kind, id, what was sent)."""
    with httpx.Client(base_url=url, timeout=10) as c:
        for i in range(10_000):
            if stop.is_set():
                return
            try:
                if i % 2:
                    r = c.post("/v1/profiles", json=measured(name=f"{tag}-{i}"))
                    sent = f"{tag}-{i}"
                else:
                    step = 0.5 + i * 1e-3
                    r = c.post("/v1/runs", json={"plan_id": plan["id"], "report": run_report(plan["plan"], step)})
                    sent = step
            except httpx.HTTPError:
                return  # the server is gone: what it acknowledged before is the test
            if r.status_code == 201:
                acked.append(("profiles" if i % 2 else "runs", r.json()["id"], sent))


def _check(url: str, acked: list) -> None:
    with httpx.Client(base_url=url, timeout=10) as c:
        for kind, id_, sent in acked:
            r = c.get(f"/v1/{kind}/{id_}")
            assert r.status_code == 200, (kind, id_, r.text[:300])
            body = r.json()
            got = body["profile"]["name"] if kind == "profiles" else body["report"]["median_step_time_s"]
            assert got == sent, (kind, id_, got, sent)


@pytest.mark.slow
def test_nothing_acknowledged_is_lost_to_kill_9(database_url: str, live_server) -> None:  # noqa: ANN001
    acked: list = []
    with live_server(database_url) as server:
        plan = httpx.post(f"{server.url}/v1/plans", json=SMALL_PLAN, timeout=120).json()
    for kill in range(KILLS):
        with live_server(database_url) as server:
            before = len(acked)
            stop = threading.Event()
            threads = [threading.Thread(target=_writer, args=(server.url, plan, f"k{kill}w{w}", acked, stop))
                       for w in range(WRITERS)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while len(acked) < before + 20 and time.monotonic() < deadline:
                time.sleep(0.05)
            server.proc.kill()  # SIGKILL mid-stream: no shutdown, no flush
            server.proc.wait(10)
            stop.set()
            for t in threads:
                t.join(15)
            assert len(acked) >= before + 20, "the writers were too slow to load the server"
        with live_server(database_url) as again:
            _check(again.url, acked)
