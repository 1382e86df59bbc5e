"""Health probes and the write check: ``/healthz``, ``/readyz``, ``/v1/auth``."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy import text

from api.bodies import FiniteJSONRoute
from api.deps import AUTH_RESPONSES, DB, Writer

log = logging.getLogger("autopar.api")
router = APIRouter(route_class=FiniteJSONRoute, tags=["health"])


@router.get("/healthz")
def healthz() -> dict:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "database unreachable"}})
def readyz(db: DB) -> Response:
    """The database answers."""
    try:
        with db.read() as s:
            s.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        log.warning("readyz: %s", exc)
        return JSONResponse(status_code=503, content={"status": "database unreachable"})
    return JSONResponse({"status": "ready", "database": db.dialect})


@router.get("/v1/auth", dependencies=[Writer], responses={k: v for k, v in AUTH_RESPONSES.items() if k != 413})
def auth(request: Request) -> dict:
    """Whether this request may write (POST): 200 when writes are open or its bearer token is one of
    the server's AUTOPAR_TOKENS, 401/403 as a POST would get. `autopar profile` and `autopar run`
    ask before measuring, so a refused upload does not come after an hour's work."""
    return {"writes": "token accepted" if request.app.state.settings.tokens else "open"}
