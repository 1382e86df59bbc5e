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


def _start_serve(tmp_path: Path) -> tuple[subprocess.Popen, list[str], int]:
    """`autopar serve --example` on a free port, read up to its "Ctrl-C" line; a port taken between
    choosing and binding it (serve says so before migrating) is retried on another."""
    from conftest import free_port

    autopar = Path(sys.executable).parent / "autopar"
    for _ in range(3):
        port = free_port()
        proc = subprocess.Popen([str(autopar), "serve", "--port", str(port), "--example",
                                 "--database-url", f"sqlite:///{tmp_path / 'run.db'}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "AUTOPAR_TOKENS": "tok"}, cwd=tmp_path)
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("Ctrl-C" in line for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        if "cannot be listened on" not in "".join(lines):
            return proc, lines, port
        proc.wait(10)
    raise AssertionError("three free ports were taken before serve bound them:\n" + "".join(lines))


@pytest.mark.slow
def test_serve_migrates_loads_references_posts_the_example_and_prints_the_urls(tmp_path: Path) -> None:
    proc, lines, port = _start_serve(tmp_path)
    try:
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
    # a restart on the same database answers the example with the plan stored before (its Idempotency-Key)
    proc, lines, port = _start_serve(tmp_path)
    try:
        assert "example plan #1" in "".join(lines), "".join(lines)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/plans").json()["total"] == 1
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_on_a_taken_port_says_so_before_touching_the_database(tmp_path: Path) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run([str(Path(sys.executable).parent / "autopar"), "serve", "--port", str(port), "--example",
                               "--database-url", f"sqlite:///{tmp_path / 'never.db'}"],
                              capture_output=True, text=True, timeout=120)
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and "Traceback" not in text, text
    assert f"--port {port}: 127.0.0.1:{port} cannot be listened on" in text and "make run PORT=" in text, text
    assert not (tmp_path / "never.db").exists()


def test_compose_runs_the_api_on_postgresql_with_health_checks_and_a_volume() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    db, api = compose["services"]["db"], compose["services"]["api"]
    assert "pg_isready" in " ".join(db["healthcheck"]["test"])
    assert any(v.endswith(":/var/lib/postgresql/data") for v in db["volumes"])
    assert set(compose["volumes"]) >= {v.split(":")[0] for v in db["volumes"]}
    assert (
        api["environment"]["DATABASE_URL"].startswith("postgresql://") and "@db:" in api["environment"]["DATABASE_URL"]
    )
    assert api["depends_on"]["db"]["condition"] == "service_healthy"
    assert "/readyz" in " ".join(api["healthcheck"]["test"])
    assert api["command"][0] == "serve" and "0.0.0.0" in api["command"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for folder in ("planner", "api"):
        assert f"COPY {folder} ./{folder}" in dockerfile
