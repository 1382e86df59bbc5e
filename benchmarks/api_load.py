#!/usr/bin/env python3
"""Load test of the API: concurrent clients against a real uvicorn, on SQLite and PostgreSQL.

    python benchmarks/api_load.py                     # 4 server processes, 100 clients, 60 s, both backends
    python benchmarks/api_load.py --clients 10 --duration 5 --backends sqlite --workers 1

Target (issue 28): 4 server processes on PostgreSQL, 100 clients x 60 s of mixed reads, plan requests and
uploads: zero server errors, p50 and p99 latency per route, the 503s of a saturated plan pool (with
Retry-After, which the clients obey) counted apart; afterwards the row counts equal what the clients were told
was created (nothing lost, nothing duplicated).

Per backend it starts uvicorn serving ``api.app:create_app`` on a fresh database, then ``--workers - 1``
more processes on the same listening socket (the kernel spreads connections over them)
(SQLite: a new temp file; PostgreSQL: ``CREATE DATABASE autopar_load_<random>`` on the local
server, dropped afterwards), waits for ``/readyz``, then runs the clients (asyncio + httpx). Each
client loops over a weighted mix of:

* ``plan``          POST /v1/plans, small fast requests (7B-30B models, 1-4 nodes, some options),
                    a few infeasible on purpose (expected: 201 with ``status: infeasible``), a few
                    against a profile uploaded during the run (by ``profile_id``);
* ``profile_new``   POST /v1/profiles, new content under a new cluster name (expected 201);
* ``profile_ver``   POST /v1/profiles, new content under one of three shared cluster names, from
                    every client at once: version numbering under contention (expected 201);
* ``profile_dup``   POST /v1/profiles, content uploaded before (with a new ``created_at``, which is
                    not part of the content): expected 200, ``created: false``, the original id;
* ``profile_race``  POST /v1/profiles, the same new content from every client within a 0.25 s
                    window: exactly one 201 per content, all others 200 with that id;
* ``get``           lists and gets by id (expected 200).

An error is any other status, a transport exception, a duplicate answered as created, or an
answer that contradicts an earlier one. Afterwards the database is read directly (SQLAlchemy)
and through the API: plan rows == 201 plan answers, profile rows == reference profiles + ids
told created, every id a client got exists, each cluster's versions are exactly 1..n, each
content hash maps to one id; the server's log must hold no traceback. Exit code 1 on any error
or mismatch (or when PostgreSQL is unreachable and ``--require-postgres`` is given).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from api.settings import default_plan_workers  # noqa: E402

DEFAULT_PG_SERVER = os.environ.get("AUTOPAR_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
KINDS = ("plan", "profile_new", "profile_ver", "profile_dup", "profile_race", "get")
# weights of the request kinds in each client's loop
MIX = {"plan": 0.55, "profile_new": 0.10, "profile_ver": 0.08, "profile_dup": 0.06, "profile_race": 0.03, "get": 0.18}
SHARED_CLUSTERS = ("load-shared-0", "load-shared-1", "load-shared-2")
RACE_CLUSTER = "load-race"
RACE_WINDOW_S = 0.25
MAX_ERROR_SAMPLES = 15

console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)  # piped: wide enough for the tables


# -- the plan requests ---------------------------------------------------------------------------

def plan_requests() -> list[tuple[dict, str]]:
    """(request body, expected status): small requests, each well under a second of search alone."""
    out: list[tuple[dict, str]] = []
    presets = ("llama3-8b", "llama2-7b", "gpt3-1.3b", "mixtral-8x7b", "qwen3-30b-a3b")
    clusters = ("dgx-h100", "dgx-a100-80gb", "dgx-a100-40gb")
    shapes = ((2048, 32), (4096, 64), (2048, 128), (4096, 256))
    options = ({"top_k": 1}, {"top_k": 3}, {"max_pp": 1}, {"max_pp": 2, "top_k": 2})
    k = 0
    for preset in presets:
        for cluster in clusters:
            for nodes in (1, 2, 4):
                seq, batch = shapes[k % len(shapes)]
                opts = dict(options[(k // len(shapes)) % len(options)])
                if preset == "gpt3-1.3b":  # learned positions: 2048 rows, a longer sequence has no layout;
                    seq = min(seq, 2048)   # planned for Megatron-LM (the executor's decoder is RoPE only)
                    opts["target"] = "megatron"
                k += 1
                # a Mixture-of-Experts model on 40 GB GPUs needs four nodes without a pipeline (its states, the
                # CUDA context, NCCL buffers, fragmentation and the 5% headroom)
                n = max(nodes, 4) if cluster == "dgx-a100-40gb" and preset in ("mixtral-8x7b", "qwen3-30b-a3b") \
                    else nodes
                out.append(({"model": {"preset": preset}, "training": {"seq_length": seq, "global_batch_size": batch},
                             "cluster": cluster, "num_nodes": n, "options": dict(opts)}, "ok"))
    infeasible = [
        {"model": {"preset": "llama3-8b"}, "training": {"seq_length": 4096, "global_batch_size": 64},
         "cluster": "dgx-a100-40gb", "num_nodes": 1,
         "options": {"max_tp": 1, "max_pp": 1, "zero_stages": [0], "offload": False, "hsdp": False}},
        {"model": {"preset": "mixtral-8x7b"}, "training": {"seq_length": 4096, "global_batch_size": 32},
         "cluster": "dgx-a100-40gb", "num_nodes": 1,
         "options": {"max_pp": 1, "max_tp": 1, "max_ep": 1, "zero_stages": [0, 1], "offload": False}},
        {"model": {"preset": "llama2-7b"}, "training": {"seq_length": 2048, "global_batch_size": 32},
         "cluster": "dgx-a100-80gb", "num_nodes": 1, "options": {"memory_headroom": 0.85, "offload": False}},
    ]
    out += [(body, "infeasible") for body in infeasible]
    return out


PLAN_REQUESTS = plan_requests()


# -- bookkeeping -----------------------------------------------------------------------------------

@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class BackendResult:
    backend: str
    clients: int = 0
    duration_s: float = 0.0
    elapsed_s: float = 0.0
    skipped: str | None = None
    counts: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    plan_status: Counter = field(default_factory=Counter)
    shed: Counter = field(default_factory=Counter)  # 503 + Retry-After answers: load shed, not errors
    workers: int = 1
    checks: list[Check] = field(default_factory=list)
    server_log_tail: str = ""

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def rows_ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def ok(self) -> bool:
        return self.skipped is None and self.error_count == 0 and self.rows_ok

    def all_latencies(self) -> list[float]:
        return [x for v in self.latencies.values() for x in v]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    rank = max(1, min(len(s), int(-(-q * len(s) // 100))))  # ceil(q/100 * n)
    return s[rank - 1]


class LoadState:
    """What every client was told, shared by the clients (one event loop: no locks needed)."""

    def __init__(self, http: httpx.AsyncClient, base_profile: dict, result: BackendResult, deadline: float,
                 started: float):
        self.http, self.base_profile, self.result = http, base_profile, result
        self.deadline, self.started = deadline, started
        self.plan_ids: list[int] = []                       # every id of a 201 plan answer
        self.created_profiles: dict[int, tuple[str, int, str]] = {}  # id -> (cluster, version, content_hash)
        self.created_twice: list[int] = []
        self.uploaded: list[tuple[dict, int]] = []          # (profile body, id): for duplicates
        self.hash_ids: dict[str, set[int]] = defaultdict(set)  # content hash -> ids answered
        self.race: dict[str, list[bool]] = defaultdict(list)   # race content hash -> created flags
        self.dup_checked = 0

    def error(self, kind: str, message: str) -> None:
        self.result.errors[kind] += 1
        if len(self.result.error_samples) < MAX_ERROR_SAMPLES:
            self.result.error_samples.append(f"[{kind}] {message}")

    async def call(self, kind: str, method: str, path: str, body: dict | None = None,
                   expect: tuple[int, ...] = (200,)) -> httpx.Response | None:
        self.result.counts[kind] += 1
        t0 = time.perf_counter()
        try:
            resp = await self.http.request(method, path, json=body)
        except Exception as exc:  # noqa: BLE001 - any transport failure is an error
            self.result.latencies[kind].append(time.perf_counter() - t0)
            self.error(kind, f"{method} {path}: {type(exc).__name__}: {exc!r} after {time.perf_counter() - t0:.3f} s, "
                             f"at t={time.monotonic() - self.started:.1f} s")
            return None
        self.result.latencies[kind].append(time.perf_counter() - t0)
        if resp.status_code == 503 and "Retry-After" in resp.headers and method == "POST":
            self.result.shed[kind] += 1  # a saturated service said when to come back: it is heard, not an error
            await asyncio.sleep(min(float(resp.headers["Retry-After"]), max(0.0, self.deadline - time.monotonic())))
            return None
        if resp.status_code not in expect:
            self.error(kind, f"{method} {path}: HTTP {resp.status_code} (expected {expect}): {resp.text[:300]}")
            return None
        return resp


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _profile(state: LoadState, name: str, marker: str) -> dict:
    body = copy.deepcopy(state.base_profile)
    body["name"] = name
    body["kind"] = "reference"
    body["environment"]["hostnames"] = [marker]  # the content differs by this marker
    body["created_at"] = _now()
    return body


# -- one client -------------------------------------------------------------------------------------

async def _plan(state: LoadState, rng: random.Random) -> None:
    if state.created_profiles and rng.random() < 0.1:
        pid = rng.choice(list(state.created_profiles))
        preset = rng.choice(("gpt3-1.3b", "llama3-8b"))
        body = {"model": {"preset": preset},
                "training": {"seq_length": 2048, "global_batch_size": rng.choice((32, 64))},
                "profile_id": pid, "num_nodes": rng.choice((1, 2)),
                "options": {"top_k": 2, **({"target": "megatron"} if preset == "gpt3-1.3b" else {})}}
        expected = "ok"
    else:
        body, expected = rng.choice(PLAN_REQUESTS)
    resp = await state.call("plan", "POST", "/v1/plans", body, expect=(201,))
    if resp is None:
        return
    out = resp.json()
    state.plan_ids.append(out["id"])
    state.result.plan_status[out["status"]] += 1
    if out["status"] != expected:
        state.error("plan", f"plan {out['id']}: status {out['status']!r}, expected {expected!r}: "
                            f"{(out.get('explanation') or {}).get('message', '')[:200]}")


async def _upload(state: LoadState, kind: str, body: dict, expect: tuple[int, ...]) -> dict | None:
    resp = await state.call(kind, "POST", "/v1/profiles", body, expect=expect)
    if resp is None:
        return None
    out = resp.json()
    if out["created"] != (resp.status_code == 201):
        state.error(kind, f"profile {out['id']}: HTTP {resp.status_code} but created={out['created']}")
    if out["cluster"] != body["name"]:
        state.error(kind, f"profile {out['id']}: cluster {out['cluster']!r}, uploaded as {body['name']!r}")
    state.hash_ids[out["content_hash"]].add(out["id"])
    if out["created"]:
        if out["id"] in state.created_profiles:
            state.created_twice.append(out["id"])
            state.error(kind, f"profile {out['id']} answered created=true twice")
        state.created_profiles[out["id"]] = (out["cluster"], out["version"], out["content_hash"])
        state.uploaded.append((body, out["id"]))
    return out


async def _profile_new(state: LoadState, rng: random.Random, client: int, n: int) -> None:
    await _upload(state, "profile_new", _profile(state, f"load-{client}-{n}", f"new-{client}-{n}"), (201,))


async def _profile_ver(state: LoadState, rng: random.Random, client: int, n: int) -> None:
    await _upload(state, "profile_ver", _profile(state, rng.choice(SHARED_CLUSTERS), f"ver-{client}-{n}"), (201,))


async def _profile_dup(state: LoadState, rng: random.Random, client: int, n: int) -> None:
    if not state.uploaded:
        await _profile_new(state, rng, client, n)
        return
    original, pid = rng.choice(state.uploaded)
    body = copy.deepcopy(original)
    body["created_at"] = _now()  # not part of the content: still the same profile
    out = await _upload(state, "profile_dup", body, (200,))
    if out is None:
        return
    state.dup_checked += 1
    if out["id"] != pid or out["created"]:
        state.error("profile_dup", f"duplicate of profile {pid} answered id={out['id']} created={out['created']}")


async def _profile_race(state: LoadState, rng: random.Random, client: int, n: int) -> None:
    slot = int((time.monotonic() - state.started) / RACE_WINDOW_S)
    out = await _upload(state, "profile_race", _profile(state, RACE_CLUSTER, f"race-{slot}"), (200, 201))
    if out is not None:
        state.race[out["content_hash"]].append(out["created"])


async def _get(state: LoadState, rng: random.Random) -> None:
    choice = rng.randrange(6)
    if choice == 0:
        await state.call("get", "GET", f"/v1/plans?limit={rng.choice((5, 20))}")
    elif choice == 1:
        await state.call("get", "GET", f"/v1/profiles?limit={rng.choice((5, 20))}")
    elif choice == 2:
        await state.call("get", "GET", "/v1/clusters?limit=50")
    elif choice == 3 and state.plan_ids:
        pid = rng.choice(state.plan_ids)
        resp = await state.call("get", "GET", f"/v1/plans/{pid}")
        if resp is not None and resp.json()["id"] != pid:
            state.error("get", f"GET /v1/plans/{pid} answered id {resp.json()['id']}")
    elif choice == 4 and state.created_profiles:
        pid = rng.choice(list(state.created_profiles))
        resp = await state.call("get", "GET", f"/v1/profiles/{pid}")
        if resp is not None:
            out = resp.json()
            cluster, version, digest = state.created_profiles[pid]
            if (out["id"], out["cluster"], out["version"], out["content_hash"]) != (pid, cluster, version, digest):
                state.error("get", f"GET /v1/profiles/{pid} differs from its upload answer")
    elif choice == 5 and any(c == SHARED_CLUSTERS[0] for c, _, _ in state.created_profiles.values()):
        await state.call("get", "GET", f"/v1/clusters/{SHARED_CLUSTERS[0]}/profiles")
    else:
        await state.call("get", "GET", "/v1/plans?limit=5")


async def client(state: LoadState, index: int, seed: int) -> None:
    rng = random.Random(seed * 100_003 + index)
    kinds, weights = list(MIX), list(MIX.values())
    n = 0
    while time.monotonic() < state.deadline:
        n += 1
        kind = rng.choices(kinds, weights)[0]
        if kind == "plan":
            await _plan(state, rng)
        elif kind == "get":
            await _get(state, rng)
        else:
            await {"profile_new": _profile_new, "profile_ver": _profile_ver, "profile_dup": _profile_dup,
                   "profile_race": _profile_race}[kind](state, rng, index, n)


# -- servers and databases -------------------------------------------------------------------------

def listening_socket() -> socket.socket:
    """A TCP socket bound to a free loopback port and listening, for :func:`serve_on`: the port
    cannot be taken between choosing it and serving on it (a client's ephemeral port once took it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


# uvicorn serving on an inherited listening socket. Not `uvicorn --fd`: that wraps the socket as
# AF_UNIX, so asyncio does not set TCP_NODELAY on its connections and every response waits out a
# delayed ACK (the schemathesis run took 120 s instead of 19 s)
_SERVE_ON_FD = ("import socket, sys, uvicorn; sock = socket.socket(fileno=int(sys.argv[1])); "
                "uvicorn.Server(uvicorn.Config('api.app:create_app', factory=True, log_level='warning')).run([sock])")


def serve_on(sock: socket.socket, **popen) -> subprocess.Popen:
    """``api.app:create_app`` under uvicorn in a subprocess, serving on ``sock`` (which it inherits;
    close it here afterwards)."""
    return subprocess.Popen([sys.executable, "-c", _SERVE_ON_FD, str(sock.fileno())], pass_fds=[sock.fileno()],
                            **popen)


def postgres_unavailable(server_url: str) -> str | None:
    """None when the server answers, else why not."""
    try:
        import psycopg

        psycopg.connect(server_url, autocommit=True, connect_timeout=3).close()
        return None
    except Exception as exc:  # noqa: BLE001
        return (f"PostgreSQL at {server_url} unreachable: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}")


class FreshDatabase:
    """A new empty database: ``url`` while inside; SQLite file removed / PostgreSQL database dropped on exit."""

    def __init__(self, backend: str, pg_server: str = DEFAULT_PG_SERVER):
        self.backend, self.pg_server = backend, pg_server

    def __enter__(self) -> FreshDatabase:
        if self.backend == "sqlite":
            self.dir = tempfile.mkdtemp(prefix="autopar-load-")
            self.url = f"sqlite:///{self.dir}/load.db"
        else:
            import psycopg

            self.name = f"autopar_load_{uuid.uuid4().hex[:10]}"
            with psycopg.connect(self.pg_server, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'CREATE DATABASE "{self.name}"')
            self.url = f"{self.pg_server.rsplit('/', 1)[0]}/{self.name}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.backend == "sqlite":
            import shutil

            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            import psycopg

            with psycopg.connect(self.pg_server, autocommit=True, connect_timeout=5) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


class Server:
    """uvicorn serving ``api.app:create_app`` on a free loopback port, its output in a temp file."""

    def __init__(self, database_url: str, workers: int = 1):
        self.database_url, self.workers = database_url, workers
        self._sock = listening_socket()
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = ""

    def __enter__(self) -> Server:
        self._log = tempfile.NamedTemporaryFile("w+", prefix="autopar-load-server-", suffix=".log", delete=False)
        env = {**os.environ, "DATABASE_URL": self.database_url,
               # the machine's cores shared by the processes, as `autopar serve --workers N` shares them
               "AUTOPAR_PLAN_WORKERS": os.environ.get("AUTOPAR_PLAN_WORKERS",
                                                      str(default_plan_workers(self.workers)))}
        env.pop("AUTOPAR_TOKENS", None)
        env.pop("AUTOPAR_LOAD_REFERENCE", None)
        self.proc = serve_on(self._sock, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.procs = [self.proc]
        if self._ready(time.monotonic() + 90):  # the first migrated and loaded the reference profiles
            # the others share the listening socket (the kernel hands each connection to one of them), as
            # `autopar serve --workers N` runs after migrating once
            self.procs += [serve_on(self._sock, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
                           for _ in range(self.workers - 1)]
            self._sock.close()  # the servers hold their own copies
            time.sleep(3.0 if self.workers > 1 else 0.0)  # imports and lifespans of the others
            if all(p.poll() is None for p in self.procs):
                return self
        self._sock.close()
        self.__exit__(None, None, None)
        raise RuntimeError(f"the server did not become ready (exit code {self.proc.returncode}):\n{self.log[-4000:]}")

    def _ready(self, deadline: float) -> bool:
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        return False

    def __exit__(self, *exc: object) -> None:
        for proc in getattr(self, "procs", [self.proc]):
            proc.terminate()
        for proc in getattr(self, "procs", [self.proc]):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.seek(0)
        self.log = self._log.read()
        self._log.close()
        os.unlink(self._log.name)


# -- verification ----------------------------------------------------------------------------------

def verify(result: BackendResult, state: LoadState, database_url: str, server_url: str,
           ref_ids: set[int], plans_before: set[int]) -> None:
    from sqlalchemy import select

    from api.db import Cluster, Database, PlanRow, Profile
    from api.settings import normalise_database_url

    checks = result.checks

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append(Check(name, bool(ok), detail))

    with httpx.Client(base_url=server_url, timeout=60) as http:
        api_plans = http.get("/v1/plans", params={"limit": 1}).json()["total"]
        api_profiles = http.get("/v1/profiles", params={"limit": 1}).json()["total"]
        shared_api = {}
        for name in (*SHARED_CLUSTERS, RACE_CLUSTER):
            r = http.get(f"/v1/clusters/{name}/profiles", params={"limit": 500})
            shared_api[name] = [p["version"] for p in r.json()["items"]] if r.status_code == 200 else []

    db = Database(normalise_database_url(database_url))
    try:
        with db.read() as s:
            db_plan_ids = list(s.scalars(select(PlanRow.id)))
            db_profiles = s.execute(select(Profile.id, Cluster.name, Profile.version, Profile.content_hash)
                                    .join(Cluster, Cluster.id == Profile.cluster_id)).all()
    finally:
        db.dispose()

    told_plans = state.plan_ids
    expected_plans = len(plans_before) + len(told_plans)
    check("plan rows == 201 answers",
          len(db_plan_ids) == expected_plans and api_plans == expected_plans,
          f"db={len(db_plan_ids)} api={api_plans} told={len(told_plans)} (+{len(plans_before)} before)")
    check("plan ids distinct and all stored",
          len(set(told_plans)) == len(told_plans) and set(db_plan_ids) == set(told_plans) | plans_before,
          f"distinct told={len(set(told_plans))}/{len(told_plans)}, "
          f"missing={len(set(told_plans) - set(db_plan_ids))}, "
          f"unexpected={len(set(db_plan_ids) - set(told_plans) - plans_before)}")

    db_profile_ids = {row.id for row in db_profiles}
    created = set(state.created_profiles)
    check("profile rows == reference + told created",
          len(db_profiles) == len(ref_ids) + len(created) and api_profiles == len(db_profiles)
          and db_profile_ids - ref_ids == created and not state.created_twice,
          f"db={len(db_profiles)} api={api_profiles} reference={len(ref_ids)} told created={len(created)} "
          f"created twice={len(state.created_twice)}")
    answered = {i for ids in state.hash_ids.values() for i in ids}
    check("every profile id answered exists", answered <= db_profile_ids,
          f"{len(answered)} ids answered, missing={sorted(answered - db_profile_ids)[:10]}")

    by_cluster: dict[str, list[int]] = defaultdict(list)
    for row in db_profiles:
        by_cluster[row.name].append(row.version)
    gaps = {name: sorted(v) for name, v in by_cluster.items() if sorted(v) != list(range(1, len(v) + 1))}
    shared_versions = {name: len(by_cluster.get(name, [])) for name in (*SHARED_CLUSTERS, RACE_CLUSTER)}
    api_gaps = {n: v for n, v in shared_api.items() if v != list(range(1, len(v) + 1)) or len(v) != shared_versions[n]}
    check("versions per cluster are 1..n", not gaps and not api_gaps,
          f"{len(by_cluster)} clusters; contended: " + ", ".join(f"{k}={v}" for k, v in shared_versions.items())
          + (f"; BAD db={dict(list(gaps.items())[:3])} api={api_gaps}" if gaps or api_gaps else ""))
    db_by_id = {row.id: (row.name, row.version, row.content_hash) for row in db_profiles}
    wrong = [i for i, told in state.created_profiles.items() if db_by_id.get(i) != told]
    check("told (cluster, version, hash) == stored", not wrong, f"{len(created)} compared, {len(wrong)} differ")

    multi = {h: ids for h, ids in state.hash_ids.items() if len(ids) != 1}
    db_hashes = Counter(row.content_hash for row in db_profiles)
    check("one id per content", not multi and max(db_hashes.values()) == 1,
          f"{len(state.hash_ids)} contents answered; with more than one id: {len(multi)}")
    races_bad = {h: flags for h, flags in state.race.items() if flags.count(True) != 1}
    check("duplicates answered the original id",
          result.errors["profile_dup"] == 0 and not races_bad,
          f"{state.dup_checked} duplicates; {len(state.race)} raced contents "
          f"({sum(len(f) for f in state.race.values())} uploads), with != 1 created: {len(races_bad)}")


# -- one backend -----------------------------------------------------------------------------------

async def _run_clients(state: LoadState, clients: int, seed: int) -> None:
    await asyncio.gather(*(client(state, i, seed) for i in range(clients)))


async def _load(server_url: str, result: BackendResult, clients: int, duration: float, seed: int,
                base_profile: dict) -> LoadState:
    # idle connections expire on the client (2 s) before uvicorn's keep-alive timeout (5 s) closes them,
    # so a request is never sent on a connection the server is closing (httpx's default is also 5 s)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=server_url, limits=limits, timeout=httpx.Timeout(300.0)) as http:
        started = time.monotonic()
        state = LoadState(http, base_profile, result, started + duration, started)
        await _run_clients(state, clients, seed)
        result.elapsed_s = time.monotonic() - started
    return state


def run_backend(backend: str, clients: int = 50, duration: float = 60.0, seed: int = 0,
                pg_server: str = DEFAULT_PG_SERVER, quiet: bool = False, workers: int = 1) -> BackendResult:
    """Start a server on a fresh database of ``backend``, load it, verify the rows. Never raises for
    what it measures: errors and mismatches are in the result (``skipped`` when PostgreSQL is away)."""
    result = BackendResult(backend, clients=clients, duration_s=duration, workers=workers)
    if backend == "postgresql":
        why = postgres_unavailable(pg_server)
        if why:
            result.skipped = why
            return result
    elif backend != "sqlite":
        raise ValueError(f"unknown backend {backend!r}: use sqlite or postgresql")
    with FreshDatabase(backend, pg_server) as fresh:
        server = Server(fresh.url, workers)
        with server:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                profiles = http.get("/v1/profiles", params={"limit": 500}).json()
                ref_ids = {p["id"] for p in profiles["items"]}
                base_profile = http.get(f"/v1/profiles/{min(ref_ids)}").json()["profile"]
                plans = http.get("/v1/plans", params={"limit": 500}).json()
                plans_before = {p["id"] for p in plans["items"]}
            if not quiet:
                console.print(f"[bold]{backend}[/]: {workers} server process(es) {server.url} on {_safe(fresh.url)}; "
                              f"{len(ref_ids)} reference profiles; {clients} clients for {duration:g} s ...")
            state = asyncio.run(_load(server.url, result, clients, duration, seed, base_profile))
            verify(result, state, fresh.url, server.url, ref_ids, plans_before)
        tracebacks = server.log.count("Traceback (most recent call last)")
        result.checks.append(Check("no traceback in the server log", tracebacks == 0,
                                   f"{tracebacks} tracebacks, {len(server.log.splitlines())} log lines"))
        if tracebacks or result.error_count:
            result.server_log_tail = server.log[-6000:]
    return result


def _safe(url: str) -> str:
    return url.split("@")[-1] if "@" in url else url


# -- printing --------------------------------------------------------------------------------------

def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1000:.0f}"


def print_result(r: BackendResult) -> None:
    if r.skipped:
        console.print(f"[yellow]{r.backend}: skipped: {r.skipped}[/]")
        return
    t = Table(title=f"{r.backend}: {r.workers} worker(s), {r.clients} clients, {r.elapsed_s:.1f} s, "
                    f"{r.total} requests, {r.total / r.elapsed_s:.1f} req/s", title_justify="left")
    for col in ("kind", "requests", "errors", "503 shed", "p50 ms", "p99 ms", "max ms", "req/s"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    rows = [(k, r.latencies.get(k, []), r.counts[k], r.errors[k]) for k in KINDS]
    rows.append(("all", r.all_latencies(), r.total, r.error_count))
    for kind, lat, n, err in rows:
        shed = sum(r.shed.values()) if kind == "all" else r.shed[kind]
        t.add_row(kind, str(n), f"[red]{err}[/]" if err else "0", str(shed), _ms(percentile(lat, 50)),
                  _ms(percentile(lat, 99)),
                  _ms(max(lat) if lat else float("nan")), f"{n / r.elapsed_s:.1f}", end_section=kind == KINDS[-1])
    console.print(t)
    console.print(f"plans: {dict(r.plan_status)}")
    c = Table(title=f"{r.backend}: rows after the load", title_justify="left")
    c.add_column("check")
    c.add_column("result")
    c.add_column("detail")
    for chk in r.checks:
        c.add_row(chk.name, "[green]PASS[/]" if chk.ok else "[red]FAIL[/]", chk.detail)
    console.print(c)
    if r.error_samples:
        console.print("[red]first errors:[/]")
        for e in r.error_samples:
            console.print("  " + e)
    if r.server_log_tail:
        console.print("[red]server log (tail):[/]\n" + r.server_log_tail)


def summary_line(r: BackendResult) -> str:
    if r.skipped:
        return f"{r.backend}: skipped ({r.skipped})"
    lat = r.all_latencies()
    return (f"{r.backend}: workers={r.workers} errors={r.error_count} shed_503={sum(r.shed.values())} "
            f"p50={_ms(percentile(lat, 50))}ms p99={_ms(percentile(lat, 99))}ms "
            f"requests={r.total} throughput={r.total / r.elapsed_s:.1f}req/s rows={'OK' if r.rows_ok else 'MISMATCH'}")


def print_summary(results: list[BackendResult]) -> None:
    t = Table(title="summary", title_justify="left")
    for col in ("backend", "requests", "req/s", "errors", "p50 ms", "p99 ms", "max ms", "plan p50", "plan p99",
                "upload p50", "upload p99", "rows"):
        t.add_column(col, justify="left" if col in ("backend", "rows") else "right")
    for r in results:
        if r.skipped:
            t.add_row(r.backend, *["-"] * 10, "skipped")
            continue
        lat = r.all_latencies()
        up = [x for k in KINDS if k.startswith("profile") for x in r.latencies.get(k, [])]
        plan = r.latencies.get("plan", [])
        t.add_row(r.backend, str(r.total), f"{r.total / r.elapsed_s:.1f}", str(r.error_count),
                  _ms(percentile(lat, 50)), _ms(percentile(lat, 99)), _ms(max(lat) if lat else float("nan")),
                  _ms(percentile(plan, 50)), _ms(percentile(plan, 99)),
                  _ms(percentile(up, 50)), _ms(percentile(up, 99)),
                  "[green]OK[/]" if r.rows_ok else "[red]MISMATCH[/]")
    console.print(t)
    for r in results:
        console.print(summary_line(r))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--workers", type=int, default=4, help="server processes sharing the listening socket")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per backend")
    ap.add_argument("--backends", default="sqlite,postgresql", help="comma-separated: sqlite, postgresql")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--postgres-server", default=DEFAULT_PG_SERVER,
                    help="a PostgreSQL URL to CREATE/DROP the load database from (default $AUTOPAR_TEST_POSTGRES "
                         "or postgresql://postgres@127.0.0.1:5432/test)")
    ap.add_argument("--require-postgres", action="store_true", help="fail (instead of skipping) without PostgreSQL")
    args = ap.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in ("sqlite", "postgresql"):
            ap.error(f"unknown backend {b!r}: use sqlite and/or postgresql")
    console.print(f"api load: {args.workers} server process(es), {args.clients} clients x {args.duration:g} s per "
                  "backend, mix "
                  + ", ".join(f"{k} {w:.0%}" for k, w in MIX.items())
                  + f"; {len(PLAN_REQUESTS)} distinct plan requests (+ plans on uploaded profiles); "
                  f"{os.cpu_count()} CPUs")
    results = []
    for b in backends:
        r = run_backend(b, args.clients, args.duration, args.seed, args.postgres_server, workers=args.workers)
        print_result(r)
        results.append(r)
    print_summary(results)
    failed = [r for r in results if not r.skipped and not r.ok]
    missing_pg = [r for r in results if r.skipped and r.backend == "postgresql" and args.require_postgres]
    if missing_pg:
        console.print("[red]PostgreSQL required (--require-postgres) but unreachable[/]")
    return 1 if failed or missing_pg else 0


if __name__ == "__main__":
    sys.exit(main())
