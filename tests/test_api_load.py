"""A short run of benchmarks/api_load.py: 10 clients for 5 s against uvicorn on SQLite and PostgreSQL.

Zero errors, and the rows afterwards are exactly what the clients were told was created (plans,
profiles, versions 1..n per cluster under concurrent uploads, duplicates answered with the
original id). PostgreSQL: skipped with the reason when the local server is unreachable, a failure
in CI (``CI`` set). The full target (50 clients, 60 s) is ``python benchmarks/api_load.py``.
"""

from __future__ import annotations

import os

import pytest
from conftest import api_load  # benchmarks/api_load.py, loaded by path

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_short_load(backend: str) -> None:
    if backend == "postgresql":
        why = api_load.postgres_unavailable(api_load.DEFAULT_PG_SERVER)
        if why:
            if os.environ.get("CI"):
                pytest.fail(why + " — CI must run the load test on PostgreSQL")
            pytest.skip(why)
    result = api_load.run_backend(backend, clients=10, duration=5.0, seed=1, quiet=True)
    assert result.skipped is None, result.skipped
    report = "\n".join([api_load.summary_line(result), *result.error_samples,
                        *(f"{c.name}: {'PASS' if c.ok else 'FAIL'} {c.detail}" for c in result.checks),
                        result.server_log_tail])
    assert result.total > 20, report
    assert result.counts["plan"] > 0 and sum(result.counts[k] for k in api_load.KINDS if k.startswith("profile")) > 0, (
        report
    )
    assert result.error_count == 0, report
    assert result.rows_ok, report
    assert {c.name for c in result.checks} >= {
        "plan rows == 201 answers",
        "profile rows == reference + told created",
        "versions per cluster are 1..n",
        "no traceback in the server log",
    }
