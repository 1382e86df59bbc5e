"""`autopar serve` (what `make run` starts) and the deployment files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_serve_migrates_loads_references_posts_the_example_and_prints_the_urls(tmp_path: Path) -> None:
    from conftest import free_port

    port = free_port()
    autopar = Path(sys.executable).parent / "autopar"
    proc = subprocess.Popen([str(autopar), "serve", "--port", str(port), "--example",
                             "--database-url", f"sqlite:///{tmp_path / 'run.db'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "AUTOPAR_TOKENS": "tok"}, cwd=tmp_path)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("Ctrl-C" in line for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        out = "".join(lines)
        assert "7 reference profiles and 1 measured (8 new)" in out, out
        assert "example plan #1" in out and f"http://127.0.0.1:{port}/plans/1" in out, out
        assert f"http://127.0.0.1:{port}/docs" in out and "Authorization: Bearer" in out, out
        plan = httpx.get(f"http://127.0.0.1:{port}/v1/plans/1").json()
        assert plan["status"] == "ok" and plan["num_gpus"] == 64
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200 and "dgx-h100" in httpx.get(f"http://127.0.0.1:{port}/").text
        assert httpx.get(f"http://127.0.0.1:{port}/plans/1").status_code == 200
        assert httpx.post(f"http://127.0.0.1:{port}/v1/plans", json={}).status_code == 401  # tokens configured
    finally:
        proc.terminate()
        proc.wait(10)


def test_compose_runs_the_api_on_postgresql_with_health_checks_and_a_volume() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    db, api = compose["services"]["db"], compose["services"]["api"]
    assert "pg_isready" in " ".join(db["healthcheck"]["test"])
    assert any(v.endswith(":/var/lib/postgresql/data") for v in db["volumes"])
    assert set(compose["volumes"]) >= {v.split(":")[0] for v in db["volumes"]}
    assert api["environment"]["DATABASE_URL"].startswith("postgresql://") and "@db:" in api["environment"]["DATABASE_URL"]
    assert api["depends_on"]["db"]["condition"] == "service_healthy"
    assert "/readyz" in " ".join(api["healthcheck"]["test"])
    assert api["command"][0] == "serve" and "0.0.0.0" in api["command"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for folder in ("planner", "api"):
        assert f"COPY {folder} ./{folder}" in dockerfile
