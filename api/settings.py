"""Service settings, read from the environment (12-factor): one place, validated, documented.

=========================  ==========================================================================
``DATABASE_URL``           SQLAlchemy URL; default ``sqlite:///autopar.db`` (a file in the working
                           directory). ``postgresql://user@host/db`` uses psycopg 3.
``AUTOPAR_TOKENS``         comma-separated bearer tokens; when set, every write (POST) needs
                           ``Authorization: Bearer <token>``. Reads stay open.
``AUTOPAR_MAX_BODY_BYTES`` largest request body accepted (default 8 MiB; a measured profile with
                           every sample point is well under 1 MiB).
``AUTOPAR_CORS_ORIGINS``   comma-separated origins allowed by CORS; unset = CORS off.
``AUTOPAR_LOAD_REFERENCE`` ``0`` to skip loading the reference cluster profiles at start-up.
``AUTOPAR_PLAN_BUDGET_S``  largest search time budget a plan request may ask for (default 60).
``AUTOPAR_TUNE``           ``0`` to refuse tune jobs (``POST /v1/tune`` answers 503): a service whose host
                           should not run training (default on: the runs use this host).
``AUTOPAR_TUNE_DIR``       where tune jobs keep their runs' plans, reports and logs (default: a folder
                           under the system's temporary directory).
=========================  ==========================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from planner.errors import AutoparError

DEFAULT_DATABASE_URL = "sqlite:///autopar.db"


def normalise_database_url(url: str) -> str:
    """``postgresql://`` and ``postgres://`` mean psycopg 3 here (SQLAlchemy would pick psycopg2)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    if not url.startswith(("sqlite", "postgresql+psycopg")):
        raise AutoparError("DATABASE_URL", url, "use sqlite:///path.db or postgresql://user@host:port/db",
                           problem="is not a supported database")
    return url


def _split(text: str | None) -> tuple[str, ...]:
    return tuple(t.strip() for t in (text or "").split(",") if t.strip())


def default_plan_workers(processes: int = 1) -> int:
    """Plan searches one server process runs at once: the machine's cores over its processes (a search keeps a
    core busy for its whole budget; more at once only slows each)."""
    return max(1, (os.cpu_count() or 1) // processes)


@dataclass(frozen=True)
class Settings:
    database_url: str = DEFAULT_DATABASE_URL
    tokens: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 1024 * 1024
    cors_origins: tuple[str, ...] = ()
    load_reference: bool = True
    max_plan_budget_s: float = 60.0
    tune_jobs: bool = True
    tune_dir: str | None = None
    plan_workers: int = field(default_factory=default_plan_workers)
    plan_queue: int = field(default_factory=default_plan_workers)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "database_url", normalise_database_url(self.database_url))
        if self.plan_workers < 1 or self.plan_queue < 0:
            field_, value = (("AUTOPAR_PLAN_WORKERS", self.plan_workers) if self.plan_workers < 1
                             else ("AUTOPAR_PLAN_QUEUE", self.plan_queue))
            raise AutoparError(field_, value, "give searches at least 1 worker and a queue of 0 or more",
                               problem="leaves no room for a plan search")
        if self.max_body_bytes < 1024:
            raise AutoparError("AUTOPAR_MAX_BODY_BYTES", self.max_body_bytes, "give at least 1024 bytes",
                               problem="is too small to hold any request")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)

        def number(name: str, default: float, kind: type) -> float:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return kind(raw)
            except ValueError:
                raise AutoparError(name, raw, f"give a number, e.g. {default}", problem="is not a number") from None

        return cls(
            database_url=env.get("DATABASE_URL") or DEFAULT_DATABASE_URL,
            tokens=_split(env.get("AUTOPAR_TOKENS")),
            max_body_bytes=int(number("AUTOPAR_MAX_BODY_BYTES", 8 * 1024 * 1024, int)),
            cors_origins=_split(env.get("AUTOPAR_CORS_ORIGINS")),
            load_reference=env.get("AUTOPAR_LOAD_REFERENCE", "1") not in ("0", "false", "no"),
            max_plan_budget_s=float(number("AUTOPAR_PLAN_BUDGET_S", 60.0, float)),
            tune_jobs=env.get("AUTOPAR_TUNE", "1") not in ("0", "false", "no"),
            tune_dir=env.get("AUTOPAR_TUNE_DIR") or None,
            plan_workers=(workers := int(number("AUTOPAR_PLAN_WORKERS", default_plan_workers(), int))),
            plan_queue=int(number("AUTOPAR_PLAN_QUEUE", workers, int)),
        )
