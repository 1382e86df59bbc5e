"""What the service does with its database: every read and write of profiles, plans, runs and tune jobs.

Routes and pages call these functions with a :class:`~api.db.Database`; each write is one transaction.
Races between concurrent clients are settled by the database's unique constraints (content hash,
cluster name, cluster + version), never by checking first and writing after.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, NamedTuple, TypeVar

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.db import Cluster, Database, PlanRow, Profile, RunRow, TuneJob, utcnow
from planner.client import mesh
from planner.contracts import ClusterProfile, RunReport
from planner.errors import AutoparError

WRITE_RETRIES = 8
T = TypeVar("T")


class ProfileEntry(NamedTuple):
    profile: Profile
    cluster: Cluster


class Uploaded(NamedTuple):
    entry: ProfileEntry
    created: bool  # False: the same content was stored before; ``entry`` is that row


class ClusterEntry(NamedTuple):
    cluster: Cluster
    latest: Profile  # the newest version
    versions: int


class PlanEntry(NamedTuple):
    plan: PlanRow
    cluster: Cluster  # the cluster of the profile the plan was made for


class RunEntry(NamedTuple):
    run: RunRow
    plan: PlanRow


class Paged(NamedTuple, Generic[T]):
    items: list[T]  # one page
    total: int  # rows matching in all


class NotFound(LookupError):
    def __init__(self, what: str, key: object):
        super().__init__(f"{what} {key!r} not found")
        self.what, self.key = what, key


def canonical_hash(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def profile_hash(profile: ClusterProfile) -> str:
    """Hash of what was measured: the profile without its timestamp (re-uploading a file is no new
    version), and without the fields left at their defaults, so a contract that gains an optional
    field (``LinkProfile.ranks_per_node``) hashes a file written before it the same as before.
    Migration 0002 rehashed the rows stored under the older rule."""
    return canonical_hash(profile.model_dump(mode="json", exclude={"created_at"}, exclude_defaults=True))


def _paged(db: Database, q, order, limit: int, offset: int) -> tuple[list, int]:  # noqa: ANN001
    """Rows of select ``q`` in ``order`` (one page) and how many rows match in all."""
    with db.read() as session:
        total = session.scalar(select(func.count()).select_from(q.subquery()))
        return list(session.execute(q.order_by(*order).limit(limit).offset(offset)).all()), total or 0


# -- profiles -------------------------------------------------------------------------------------

def _cluster_id(session: Session, name: str) -> int:
    found = session.scalar(select(Cluster.id).where(Cluster.name == name))
    if found is not None:
        return found
    row = Cluster(name=name)
    session.add(row)
    session.flush()  # a concurrent insert of the same name fails here; the caller retries
    return row.id


def upload_profile(db: Database, *, profile: ClusterProfile) -> Uploaded:
    """Store ``profile`` as the next version of its cluster, or return the stored copy of the same content."""
    digest = profile_hash(profile)
    for _ in range(WRITE_RETRIES):
        with db.write() as session:
            try:
                existing = session.scalar(select(Profile).where(Profile.content_hash == digest))
                if existing is not None:
                    cluster = session.get(Cluster, existing.cluster_id)
                    session.commit()
                    return Uploaded(ProfileEntry(existing, cluster), False)
                cid = _cluster_id(session, profile.name)
                version = (session.scalar(select(func.max(Profile.version)).where(Profile.cluster_id == cid)) or 0) + 1
                row = Profile(cluster_id=cid, version=version, content_hash=digest, kind=profile.kind,
                              gpu_name=profile.device.name, gpus_per_node=profile.gpus_per_node,
                              num_nodes=profile.num_nodes, measured_at=profile.created_at,
                              body=profile.model_dump(mode="json"))
                session.add(row)
                session.flush()
                cluster = session.get(Cluster, cid)
                session.commit()
                return Uploaded(ProfileEntry(row, cluster), True)
            except IntegrityError:
                session.rollback()  # same content, cluster or version stored concurrently: look again
    raise RuntimeError(f"could not store profile {profile.name!r} after {WRITE_RETRIES} attempts under contention")


def get_profile(db: Database, *, profile_id: int) -> ProfileEntry:
    with db.read() as session:
        row = session.get(Profile, profile_id)
        if row is None:
            raise NotFound("profile", profile_id)
        return ProfileEntry(row, session.get(Cluster, row.cluster_id))


def latest_profile(db: Database, *, cluster: str) -> ProfileEntry:
    with db.read() as session:
        c = session.scalar(select(Cluster).where(Cluster.name == cluster))
        if c is None:
            raise NotFound("cluster", cluster)
        row = session.scalar(select(Profile).where(Profile.cluster_id == c.id)
                             .order_by(Profile.version.desc()).limit(1))
        if row is None:
            raise NotFound("cluster", cluster)
        return ProfileEntry(row, c)


def list_profiles(db: Database, *, gpu: str | None = None, kind: str | None = None, cluster: str | None = None,
                  since: datetime | None = None, until: datetime | None = None, limit: int = 50,
                  offset: int = 0) -> Paged[ProfileEntry]:
    """Profiles newest first; ``gpu`` matches the device name case-insensitively as a substring (``%`` and ``_``
    are literal characters, not SQL wildcards)."""
    q = select(Profile, Cluster).join(Cluster, Cluster.id == Profile.cluster_id)
    if gpu:
        q = q.where(func.lower(Profile.gpu_name).contains(gpu.lower(), autoescape=True))
    if kind:
        q = q.where(Profile.kind == kind)
    if cluster:
        q = q.where(Cluster.name == cluster)
    if since:
        q = q.where(Profile.measured_at >= since)
    if until:
        q = q.where(Profile.measured_at <= until)
    rows, total = _paged(db, q, (Profile.uploaded_at.desc(), Profile.id.desc()), limit, offset)
    return Paged([ProfileEntry(p, c) for p, c in rows], total)


def cluster_history(db: Database, *, name: str) -> list[ProfileEntry]:
    with db.read() as session:
        c = session.scalar(select(Cluster).where(Cluster.name == name))
        if c is None:
            raise NotFound("cluster", name)
        rows = session.scalars(select(Profile).where(Profile.cluster_id == c.id).order_by(Profile.version)).all()
        return [ProfileEntry(p, c) for p in rows]


def list_clusters(db: Database, *, gpu: str | None = None, kind: str | None = None, limit: int = 50,
                  offset: int = 0) -> Paged[ClusterEntry]:
    """Clusters by name, each with its newest profile and its number of versions."""
    newest = (select(Profile.cluster_id, func.max(Profile.version).label("v"), func.count().label("n"))
              .group_by(Profile.cluster_id).subquery())
    q = (select(Cluster, Profile, newest.c.n).join(newest, newest.c.cluster_id == Cluster.id)
         .join(Profile, (Profile.cluster_id == Cluster.id) & (Profile.version == newest.c.v)))
    if gpu:
        q = q.where(func.lower(Profile.gpu_name).contains(gpu.lower(), autoescape=True))
    if kind:
        q = q.where(Profile.kind == kind)
    rows, total = _paged(db, q, (Cluster.name,), limit, offset)
    return Paged([ClusterEntry(c, p, n) for c, p, n in rows], total)


def load_reference_profiles(db: Database) -> list[Uploaded]:
    """Store the reference profile of every system in ``planner.reference`` (one node), and the
    measured profiles shipped with the planner (:func:`planner.reference.measured_profiles`), if not
    stored yet."""
    from planner.reference import list_systems, measured_profiles, reference_profile

    profiles = [reference_profile(system, 1) for system in list_systems()] + measured_profiles()
    return [upload_profile(db, profile=profile) for profile in profiles]


# -- plans -----------------------------------------------------------------------------------------

def find_reusable_plan(db: Database, *, request_hash: str) -> PlanRow | None:
    with db.read() as session:
        return session.scalar(select(PlanRow).where(PlanRow.request_hash == request_hash)
                              .order_by(PlanRow.id).limit(1))


def store_plan(db: Database, *, profile_id: int, request: dict, request_hash: str, status: str, model_name: str,
               num_gpus: int, step_time_s: float | None, plan: dict | None, explanation: dict | None,
               idempotency_key: str | None = None) -> PlanRow:
    """Store a plan; with ``idempotency_key``, the plan stored first under that key if a concurrent request
    stored one meanwhile (the key is unique)."""
    try:
        with db.write() as session, session.begin():
            row = PlanRow(profile_id=profile_id, request=request, request_hash=request_hash, status=status,
                          model_name=model_name, num_gpus=num_gpus, step_time_s=step_time_s, plan=plan,
                          explanation=explanation, idempotency_key=idempotency_key)
            session.add(row)
    except IntegrityError:
        if idempotency_key is None or (first := plan_by_key(db, idempotency_key)) is None:
            raise
        return first.plan
    return row


def plan_by_key(db: Database, key: str) -> PlanEntry | None:
    """The plan stored for the Idempotency-Key ``key``, or None."""
    with db.read() as session:
        row = session.scalar(select(PlanRow).where(PlanRow.idempotency_key == key))
        if row is None:
            return None
        prof = session.get(Profile, row.profile_id)
        return PlanEntry(row, session.get(Cluster, prof.cluster_id))


def get_plan(db: Database, *, plan_id: int) -> PlanEntry:
    with db.read() as session:
        row = session.get(PlanRow, plan_id)
        if row is None:
            raise NotFound("plan", plan_id)
        prof = session.get(Profile, row.profile_id)
        return PlanEntry(row, session.get(Cluster, prof.cluster_id))


def list_plans(db: Database, *, model: str | None = None, status: str | None = None, profile_id: int | None = None,
               limit: int = 50, offset: int = 0) -> Paged[PlanEntry]:
    q = (select(PlanRow, Cluster).join(Profile, Profile.id == PlanRow.profile_id)
         .join(Cluster, Cluster.id == Profile.cluster_id))
    if model:
        q = q.where(func.lower(PlanRow.model_name).contains(model.lower(), autoescape=True))
    if status:
        q = q.where(PlanRow.status == status)
    if profile_id:
        q = q.where(PlanRow.profile_id == profile_id)
    rows, total = _paged(db, q, (PlanRow.id.desc(),), limit, offset)
    return Paged([PlanEntry(p, c) for p, c in rows], total)


# -- runs ------------------------------------------------------------------------------------------

@dataclass
class StoredRun:
    row: RunRow
    created: bool


def _store_run(db: Database, *, plan_id: int, report: RunReport) -> StoredRun:
    with db.write() as session, session.begin():
        plan = session.get(PlanRow, plan_id)
        if plan is None:
            raise NotFound("plan", plan_id)
        if plan.status != "ok":
            raise AutoparError("plan_id", plan_id, "run a plan whose status is 'ok'",
                               problem="is an infeasible plan request (no layout to run)")
        planned, ran = mesh(plan.plan["layout"]), report.layout.model_dump(mode="json")
        if planned != mesh(ran):
            raise AutoparError(
                "report.layout", {k: ran[k] for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp")},
                "post the run to the plan it executed (this plan is "
                + " ".join(f"{k}={v}" for k, v in planned.items()) + ")",
                problem="does not match the plan's mesh")
        body = report.model_dump(mode="json")
        digest = canonical_hash({k: v for k, v in body.items() if k != "created_at"})  # what was measured
        same = session.scalar(select(RunRow).where(RunRow.plan_id == plan_id, RunRow.report_hash == digest))
        if same is not None:
            return StoredRun(same, created=False)
        row = RunRow(plan_id=plan_id, predicted_step_s=plan.step_time_s, measured_step_s=report.median_step_time_s,
                     report=body, report_hash=digest)
        session.add(row)
    return StoredRun(row, created=True)


def store_run(db: Database, *, plan_id: int, report: RunReport) -> StoredRun:
    """Store ``report`` for ``plan_id``, or find it stored: the same report posted again (a retry after a lost
    answer, twice at once) is the run stored first (``created`` False); the unique (plan, report hash) settles
    a race between two writers."""
    try:
        return _store_run(db, plan_id=plan_id, report=report)
    except IntegrityError:
        return _store_run(db, plan_id=plan_id, report=report)


def cluster_runs(db: Database, *, cluster: str) -> list[RunEntry]:
    """Every stored run of a plan made on any version of ``cluster``'s profile, oldest first."""
    with db.read() as session:
        c = session.scalar(select(Cluster).where(Cluster.name == cluster))
        if c is None:
            raise NotFound("cluster", cluster)
        rows = session.execute(select(RunRow, PlanRow).join(PlanRow, RunRow.plan_id == PlanRow.id)
                               .join(Profile, PlanRow.profile_id == Profile.id)
                               .where(Profile.cluster_id == c.id).order_by(RunRow.id)).all()
        return [RunEntry(run, plan) for run, plan in rows]


def get_run(db: Database, *, run_id: int) -> RunEntry:
    with db.read() as session:
        row = session.get(RunRow, run_id)
        if row is None:
            raise NotFound("run", run_id)
        return RunEntry(row, session.get(PlanRow, row.plan_id))


def list_runs(db: Database, *, plan_id: int | None = None, limit: int = 50,
              offset: int = 0) -> Paged[RunRow]:
    q = select(RunRow)
    if plan_id:
        q = q.where(RunRow.plan_id == plan_id)
    rows, total = _paged(db, q, (RunRow.id.desc(),), limit, offset)
    return Paged([r for (r,) in rows], total)


def run_error_summary(db: Database) -> dict:
    """Prediction error (predicted / measured - 1) over every stored run that has a prediction."""
    with db.read() as session:
        pairs = session.execute(select(RunRow.predicted_step_s, RunRow.measured_step_s)).all()
    errors = [p / m - 1 for p, m in pairs if p is not None and m > 0]
    abs_err = sorted(abs(e) for e in errors)

    def pct(q: float) -> float | None:
        if not abs_err:
            return None
        return abs_err[min(len(abs_err) - 1, int(round(q * (len(abs_err) - 1))))]

    return dict(runs=len(pairs), runs_with_prediction=len(errors),
                median_abs_error=statistics.median(abs_err) if abs_err else None, p90_abs_error=pct(0.9),
                max_abs_error=abs_err[-1] if abs_err else None,
                mean_signed_error=statistics.fmean(errors) if errors else None)


# -- tune jobs -------------------------------------------------------------------------------------

TUNE_LOG_LINES = 200  # a job keeps the last lines of its progress log
ACTIVE = ("queued", "running")


class Busy(RuntimeError):
    """A tune job is queued or running: one runs at a time (its runs take the machine)."""

    def __init__(self, job_id: int, state: str):
        super().__init__(f"tune job {job_id} is {state}")
        self.job_id, self.state = job_id, state


def this_process() -> str:
    """What ``TuneJob.owner`` names: this host and process."""
    return f"{socket.gethostname()}:{os.getpid()}"


def create_tune_job(db: Database, *, profile_id: int, cluster: str, model_name: str, request: dict) -> TuneJob:
    """A queued job holding the one active slot; :class:`Busy` naming the active job when another holds it
    (the slot's unique constraint decides between concurrent requests)."""
    for _ in range(WRITE_RETRIES):
        with db.write() as session:
            try:
                row = TuneJob(state="queued", slot=1, profile_id=profile_id, cluster=cluster, model_name=model_name,
                              request=request, owner=this_process(), done=0, total=0, log=[])
                session.add(row)
                session.commit()
                return row
            except IntegrityError:
                session.rollback()
        with db.read() as session:
            active = session.scalar(select(TuneJob).where(TuneJob.slot == 1))
        if active is not None:
            raise Busy(active.id, active.state)
    raise RuntimeError(f"could not store a tune job after {WRITE_RETRIES} attempts under contention")


def update_tune_job(db: Database, *, job_id: int, log_line: str | None = None, **values: Any) -> TuneJob:
    """Set ``values`` on the job (and ``updated_at``); ``log_line`` is appended to its log, of which the last
    :data:`TUNE_LOG_LINES` are kept. A job that ends (state done or failed) gives up the active slot."""
    with db.write() as session, session.begin():
        row = session.get(TuneJob, job_id)
        if row is None:
            raise NotFound("tune job", job_id)
        for key, value in values.items():
            setattr(row, key, value)
        if values.get("state") in ("done", "failed"):
            row.slot = None
        if log_line is not None:
            row.log = [*(row.log or []), log_line][-TUNE_LOG_LINES:]
        row.updated_at = utcnow()
    return row


def get_tune_job(db: Database, *, job_id: int) -> TuneJob:
    with db.read() as session:
        row = session.get(TuneJob, job_id)
        if row is None:
            raise NotFound("tune job", job_id)
        return row


def list_tune_jobs(db: Database, *, state: str | None = None, cluster: str | None = None, limit: int = 50,
                   offset: int = 0) -> Paged[TuneJob]:
    """Tune jobs, newest first."""
    q = select(TuneJob)
    if state:
        q = q.where(TuneJob.state == state)
    if cluster:
        q = q.where(TuneJob.cluster == cluster)
    rows, total = _paged(db, q, (TuneJob.id.desc(),), limit, offset)
    return Paged([r for (r,) in rows], total)


def _alive(owner: str | None) -> bool:
    """Whether ``owner`` ("host:pid") is a process running on this host (not this one: it is only starting)."""
    host, _, pid = (owner or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def fail_stale_tune_jobs(db: Database) -> list[int]:
    """At start-up: jobs left queued or running by a process that is gone (any but a live process of this
    host, e.g. another worker of the same server) become failed. Returns their ids."""
    with db.read() as session:
        stale = [j for j in session.scalars(select(TuneJob).where(TuneJob.state.in_(ACTIVE))) if not _alive(j.owner)]
    for job in stale:
        update_tune_job(db, job_id=job.id, state="failed", error="the service stopped during the job (it was "
                        f"{job.state}, phase {job.phase or 'none'}); post it again")
    return [j.id for j in stale]


def counts(db: Database) -> dict[str, int]:
    with db.read() as session:
        return {name: session.scalar(select(func.count()).select_from(table)) or 0
                for name, table in (("clusters", Cluster), ("profiles", Profile), ("plans", PlanRow), ("runs", RunRow))}
