"""The programs that upload to the autopar service (``autopar profile``, ``autopar run``) talk to it here.

A profile or a training run can take an hour, and its result is only worth something once it is
stored. So the service is asked *before* the work starts whether it is there and takes this token
for writes (:func:`check_writable`, ``GET /v1/auth``), and an upload that fails after the work
keeps what was measured in a file and says how to send it (:func:`post_or_keep`).

Plain HTTP (httpx), no torch: the planner's CLI and the service's own tests can use it too.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from planner.errors import AutoparError

TIMEOUT_S = 60.0


def _headers(token: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}


def _unreachable(server: str, exc: Exception) -> AutoparError:
    return AutoparError("--server", server, "check the URL and that `autopar serve` is running there",
                        problem=f"could not be reached ({exc})")


def check_writable(server: str, token: str | None, timeout_s: float = 10.0) -> str:
    """Stop with a clear message, before any measuring, if ``server`` is not an autopar service that
    takes writes with ``token``. Returns what it said (``open`` or ``token accepted``)."""
    import httpx

    url = f"{server.rstrip('/')}/v1/auth"
    try:
        r = httpx.get(url, headers=_headers(token), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise _unreachable(server, exc) from None
    if r.status_code == 401:
        raise AutoparError("--token", None, "pass --token (or set AUTOPAR_TOKEN) to one of the server's AUTOPAR_TOKENS",
                           problem=f"is missing: {server} needs a bearer token for uploads")
    if r.status_code == 403:
        raise AutoparError("--token", "***", "pass one of the server's AUTOPAR_TOKENS",
                           problem=f"is not accepted by {server}")
    try:
        writes = r.json().get("writes") if r.status_code == 200 else None
    except ValueError:
        writes = None
    if writes is None:
        raise AutoparError("--server", server, "give the base URL of an `autopar serve` (e.g. http://host:8000) "
                           "of this version or later (GET /v1/auth came with it)",
                           problem=f"answered GET /v1/auth with {r.status_code}, not as an autopar service does")
    return str(writes)


def check_plan_stored(server: str, plan_id: int, timeout_s: float = 10.0) -> None:
    """Stop before training if the service holds no plan ``plan_id`` (a run is stored beside it)."""
    import httpx

    try:
        r = httpx.get(f"{server.rstrip('/')}/v1/plans/{plan_id}", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise _unreachable(server, exc) from None
    if r.status_code == 404:
        raise AutoparError("--plan-id", plan_id, f"give the id of a plan stored there (GET {server.rstrip('/')}/v1/plans)",
                           problem=f"is not a plan stored at {server}")
    if r.status_code != 200:
        raise AutoparError("--server", server, f"the service answered {r.status_code}: {r.text[:300]}",
                           problem=f"did not return plan #{plan_id}")


def post_json(server: str, path: str, body: bytes, token: str | None, what: str) -> dict:
    """POST ``body`` (JSON bytes) to ``{server}{path}``; the service's answer, or a clear error."""
    import httpx

    try:
        r = httpx.post(f"{server.rstrip('/')}{path}", content=body, headers=_headers(token), timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise _unreachable(server, exc) from None
    if r.status_code not in (200, 201):
        raise AutoparError("--server", server, f"the service answered {r.status_code}: {r.text[:300]}"
                           + ("; pass --token" if r.status_code in (401, 403) else ""), problem=f"refused the {what}")
    return r.json()


def curl_command(server: str, path: str, file: Path, token: str | None) -> str:
    """The shell command that sends ``file`` as ``post_json`` would (the token as $AUTOPAR_TOKEN, not its value)."""
    auth = " -H \"Authorization: Bearer $AUTOPAR_TOKEN\"" if token else ""
    return (f"curl -sS -X POST {shlex.quote(server.rstrip('/') + path)} -H 'Content-Type: application/json'{auth} "
            f"--data-binary @{shlex.quote(str(file))}")


def post_or_keep(server: str, path: str, body: bytes, token: str | None, what: str, keep: Path,
                 already_kept: bool = False) -> dict:
    """:func:`post_json`, and if it fails, the body is written to ``keep`` (unless ``already_kept``:
    the caller wrote those very bytes there) and the error says where it is and how to send it."""
    try:
        return post_json(server, path, body, token, what)
    except AutoparError as exc:
        kept = keep
        if not already_kept:
            try:
                keep.parent.mkdir(parents=True, exist_ok=True)
                keep.write_bytes(body)
            except OSError as io:
                raise AutoparError(exc.field, exc.value, f"{exc.fix}; and the {what} could not be kept in {keep} "
                                   f"({io.strerror}): it is lost", problem=exc.problem) from None
        raise AutoparError(exc.field, exc.value, f"{exc.fix}. Nothing is lost: the {what} is kept in {kept}; send it "
                           f"once the service takes it: {curl_command(server, path, kept, token)}",
                           problem=exc.problem) from None


def json_bytes(obj: object) -> bytes:
    return json.dumps(obj).encode()
