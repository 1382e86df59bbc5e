"""Shared fixtures: database URLs for the storage tests, SQLite and a real PostgreSQL.

PostgreSQL: ``AUTOPAR_TEST_POSTGRES`` (a server URL, default ``postgresql://postgres@127.0.0.1:5432/test``).
Where none answers, the tests try to start the system's cluster (``pg_ctlcluster``, Debian's
packages); if that fails they are skipped with the reason — except in CI (``CI`` set), where a
missing PostgreSQL is a failure: `.ci/run` starts one.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest


def _load_api_load():  # noqa: ANN202
    """benchmarks/api_load.py as module ``api_load`` (its race-free server start serves the live-server
    fixture; test_api_load runs it), loaded by path: benchmarks/ on sys.path would shadow the
    ``executor`` package with benchmarks/executor.py."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "api_load.py"
    spec = importlib.util.spec_from_file_location("api_load", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["api_load"] = module
    spec.loader.exec_module(module)
    return module


api_load = _load_api_load()

PG_SERVER = os.environ.get("AUTOPAR_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
_pg_state: dict = {}


def _pg_connect(url: str):  # noqa: ANN202
    import psycopg

    return psycopg.connect(url, autocommit=True, connect_timeout=3)


def _start_system_postgres() -> str:
    """Start the Debian cluster if one is installed; '' on success, else what went wrong."""
    etc = Path("/etc/postgresql")
    if not etc.is_dir() or not any(etc.iterdir()):
        return "no PostgreSQL cluster under /etc/postgresql (apt-get install postgresql)"
    version = sorted(p.name for p in etc.iterdir())[-1]
    try:
        out = subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"pg_ctlcluster failed: {exc}"
    return (
        "" if out.returncode == 0 else f"pg_ctlcluster {version} main start: {out.stderr.strip() or out.stdout.strip()}"
    )


def postgres_server() -> str:
    """The server URL, or pytest.skip/fail with the reason it is unavailable."""
    if "url" not in _pg_state:
        try:
            _pg_connect(PG_SERVER).close()
            _pg_state["url"] = PG_SERVER
        except Exception as first:  # noqa: BLE001
            why = _start_system_postgres()
            try:
                if why:
                    raise RuntimeError(why)
                _pg_connect(PG_SERVER).close()
                _pg_state["url"] = PG_SERVER
            except Exception as exc:  # noqa: BLE001
                _pg_state["url"] = None
                _pg_state["why"] = f"PostgreSQL at {PG_SERVER} unavailable ({first}); starting one: {exc}"
    if _pg_state["url"] is None:
        if os.environ.get("CI"):
            pytest.fail(_pg_state["why"] + " — CI must run the storage tests on PostgreSQL (.ci/run starts it)")
        pytest.skip(_pg_state["why"])
    return _pg_state["url"]


def fresh_postgres_database() -> tuple[str, callable]:
    """A new empty database on the server: (SQLAlchemy-ready URL, drop function)."""
    server = postgres_server()
    name = f"autopar_t_{uuid.uuid4().hex[:12]}"
    with _pg_connect(server) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = server.rsplit("/", 1)[0]

    def drop() -> None:
        with _pg_connect(server) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"{base}/{name}", drop


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path):  # noqa: ANN201
    """An empty database of each kind the service supports."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'autopar.db'}"
        return
    url, drop = fresh_postgres_database()
    try:
        yield url
    finally:
        drop()


def free_port() -> int:
    """A loopback port free now; another process may take it before it is bound (LiveServer does not
    use this: it hands the server a socket already listening, benchmarks/api_load.serve_on)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """``uvicorn api.app:create_app`` in a subprocess on a free loopback port, ready when entered."""

    def __init__(self, database_url: str, **env: str):
        self.database_url, self.env = database_url, env
        self._sock = api_load.listening_socket()
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = ""

    def __enter__(self) -> LiveServer:
        import tempfile
        import time

        import httpx

        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        env = {**os.environ, "DATABASE_URL": self.database_url, **self.env}
        self.proc = api_load.serve_on(self._sock, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self._sock.close()  # the server holds its own copy
        # start-up (imports, migrations, reference profiles) takes seconds; 60 s ran out once beside the
        # suite's torchrun launches (load average 60 on 2 cores, an empty log): 150 s still ends a hang
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server did not become ready:\n{self.log}")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.seek(0)
        self.log = self._log.read()
        self._log.close()
        os.unlink(self._log.name)


@pytest.fixture
def live_server():  # noqa: ANN201
    """The LiveServer class: ``with live_server(database_url, ENV="x") as server: server.url``."""
    return LiveServer


@pytest.fixture(scope="module")
def one_intra_op_thread():  # noqa: ANN201
    """Tiny models on a shared 2-core machine: a second intra-op thread only adds contention (a loss
    test took 20 s with two threads under load, 2 s with one). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
