"""SQL storage: the tables (SQLAlchemy 2.0 typed mappings) and the engine for SQLite or PostgreSQL.

The documents themselves (ClusterProfile, Plan, RunReport) are stored whole as JSON, validated by
the planner's contracts on the way in and out; the columns beside them are what lists filter and
sort on. Profiles are immutable: a new measurement of a cluster is a new version row. Tune jobs are
the one table whose rows change: their progress while they run.
The schema is created and changed only by the Alembic migrations in ``api/migrations``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class Cluster(Base):
    """A named cluster; its measurements are the versions in ``profiles``."""

    __tablename__ = "clusters"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Profile(Base):
    __tablename__ = "profiles"
    __table_args__ = (UniqueConstraint("cluster_id", "version", name="uq_profile_version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cluster_id: Mapped[int] = mapped_column(ForeignKey("clusters.id"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    content_hash: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(16), index=True)
    gpu_name: Mapped[str] = mapped_column(String(200), index=True)
    gpus_per_node: Mapped[int] = mapped_column(Integer)
    num_nodes: Mapped[int] = mapped_column(Integer)
    measured_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    uploaded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    body: Mapped[dict] = mapped_column(JSON)


class PlanRow(Base):
    __tablename__ = "plans"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    profile_id: Mapped[int] = mapped_column(ForeignKey("profiles.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    request_hash: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16))  # "ok" | "infeasible"
    model_name: Mapped[str] = mapped_column(String(200), index=True)
    num_gpus: Mapped[int] = mapped_column(Integer)
    step_time_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    request: Mapped[dict] = mapped_column(JSON)
    plan: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    explanation: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # the client's Idempotency-Key header: a retried POST with it is answered with this plan, not stored again
    idempotency_key: Mapped[str | None] = mapped_column(String(200), nullable=True, unique=True)


class RunRow(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    plan_id: Mapped[int] = mapped_column(ForeignKey("plans.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    predicted_step_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    measured_step_s: Mapped[float] = mapped_column(Float)
    report: Mapped[dict] = mapped_column(JSON)
    # sha256 of the report's canonical JSON: the same report posted again for the plan is the stored run (a retried
    # POST never stores twice); NULL for runs stored before it was kept
    report_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    __table_args__ = (UniqueConstraint("plan_id", "report_hash", name="uq_runs_plan_report"),)


class TuneJob(Base):
    """An ``autopar tune`` job of the service (``POST /v1/tune``): its progress while it runs, its TuneReport
    and what it stored when done, or why it failed.

    ``slot`` is 1 while the job is queued or running and NULL after: its unique constraint lets one job be
    active at a time (NULLs are distinct), so two concurrent requests cannot both start one."""

    __tablename__ = "tune_jobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[str] = mapped_column(String(16), index=True)  # "queued" | "running" | "done" | "failed"
    slot: Mapped[int | None] = mapped_column(Integer, unique=True, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    profile_id: Mapped[int] = mapped_column(ForeignKey("profiles.id"), index=True)  # the profile tune started from
    cluster: Mapped[str] = mapped_column(String(200), index=True)
    model_name: Mapped[str] = mapped_column(String(200))
    request: Mapped[dict] = mapped_column(JSON)
    owner: Mapped[str | None] = mapped_column(String(300), nullable=True)  # "host:pid" of the process running it
    workdir: Mapped[str | None] = mapped_column(Text, nullable=True)
    phase: Mapped[str | None] = mapped_column(String(16), nullable=True)
    done: Mapped[int] = mapped_column(Integer, default=0)
    total: Mapped[int] = mapped_column(Integer, default=0)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    log: Mapped[list] = mapped_column(JSON, default=list)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    result: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # the TuneReport
    runs: Mapped[list | None] = mapped_column(JSON, nullable=True)  # [{name, role, plan_id, run_id}] stored
    calibrated_profile_id: Mapped[int | None] = mapped_column(ForeignKey("profiles.id"), nullable=True)
    replanned_plan_id: Mapped[int | None] = mapped_column(ForeignKey("plans.id"), nullable=True)


def make_engine(url: str) -> Engine:
    """An engine for ``url``.

    SQLite: WAL (readers never block the writer), foreign keys on, a 30 s busy timeout, and write
    transactions opened with ``BEGIN IMMEDIATE`` (see :class:`Database`): a deferred transaction
    that reads and then writes fails at once with "database is locked" when another writer got in
    between, whatever the timeout, so writers take the lock up front and queue instead.
    """
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, pool_size=20,
                               max_overflow=40)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record) -> None:  # noqa: ANN001
            dbapi_conn.isolation_level = None  # SQLAlchemy's "begin" event below emits BEGIN itself
            cur = dbapi_conn.cursor()
            if ":memory:" not in url:
                cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn) -> None:  # noqa: ANN001
            conn.exec_driver_sql("BEGIN " + conn.get_execution_options().get("sqlite_begin", "DEFERRED"))

        return engine
    return create_engine(url, pool_size=20, max_overflow=40, pool_pre_ping=True)


class Database:
    """An engine with two session factories: ``read()`` and ``write()`` (SQLite: ``BEGIN IMMEDIATE``)."""

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self.read = sessionmaker(self.engine, expire_on_commit=False)
        writer = self.engine.execution_options(sqlite_begin="IMMEDIATE") if url.startswith("sqlite") else self.engine
        self.write = sessionmaker(writer, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def dispose(self) -> None:
        self.engine.dispose()
