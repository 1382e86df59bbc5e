"""What the API's routers share: the database of the request, the query and path parameter types, the
write guard (bearer tokens) and the datetime conventions of stored rows."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.db import Database
from api.schemas import MAX_ID


def aware(dt: datetime) -> datetime:
    """Datetimes read back from SQLite are naive UTC; say so."""
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def stored_utc(dt: datetime | None, db: Database) -> datetime | None:
    """A query's datetime as the database compares it: UTC, naive on SQLite."""
    if dt is None:
        return None
    dt = dt.astimezone(UTC) if dt.tzinfo else dt.replace(tzinfo=UTC)
    return dt.replace(tzinfo=None) if db.dialect == "sqlite" else dt


def request_db(request: Request) -> Database:
    """The database of the app serving ``request`` (routes and pages alike)."""
    return request.app.state.db


DB = Annotated[Database, Depends(request_db)]
Limit = Annotated[int, Query(ge=1, le=500, description="page size")]
Offset = Annotated[int, Query(ge=0, le=10**9, description="rows to skip")]
NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL characters
Id = Annotated[int, Path(ge=1, le=MAX_ID, description="row id")]
bearer = HTTPBearer(auto_error=False, description="needed for writes when the server has AUTOPAR_TOKENS set")


def authorize(request: Request) -> None:
    """A write's bearer token against the server's AUTOPAR_TOKENS (none set: anyone writes); 401/403 otherwise.
    Writes check it before they read their body (``api.bodies.FiniteJSONRoute``): a client without a token
    hears 401, not a complaint about its JSON."""
    tokens = request.app.state.settings.tokens
    if not tokens:
        return
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    creds = HTTPAuthorizationCredentials(scheme=scheme, credentials=token.strip()) if token.strip() else None
    if creds is None or creds.scheme.lower() != "bearer":
        raise HTTPException(401, "this server needs a bearer token for writes: send 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    if not any(secrets.compare_digest(creds.credentials.encode(), t.encode()) for t in tokens):
        raise HTTPException(403, "the bearer token is not one of the server's AUTOPAR_TOKENS")


def _writer(request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
    """The Writer dependency: documents the bearer scheme in OpenAPI; the check is :func:`authorize`'s."""
    authorize(request)


Writer = Depends(_writer)
AUTH_RESPONSES: dict = {401: {"description": "no bearer token (server has AUTOPAR_TOKENS)"},
                        403: {"description": "unknown bearer token"}, 413: {"description": "body too large"}}


def link(operation: str, param: str) -> dict:
    """OpenAPI link: the created resource's id feeds the GET of it (clients and schemathesis follow it)."""
    op = {"GetProfile": "get_profile", "GetPlan": "get_plan", "GetRun": "get_run"}[operation]
    return {operation: {"operationId": op, "parameters": {param: "$response.body#/id"}}}
