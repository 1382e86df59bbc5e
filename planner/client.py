"""The programs that upload to the autopar service (``autopar profile``, ``autopar run``) talk to it here.

A profile or a training run can take an hour, and its result is only worth something once it is
stored. So the service is asked *before* the work starts whether it is there and takes this token
for writes (:func:`check_writable`, ``GET /v1/auth``), and an upload that fails after the work
keeps what was measured in a file and says how to send it (:func:`post_or_keep`).

Plain HTTP (httpx), no torch: the planner's CLI and the service's own tests can use it too.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from planner.errors import AutoparError
from planner.files import unused_path

TIMEOUT_S = 60.0


def _headers(token: str | None) -> dict[str, str]:
    if token and not all("!" <= ch <= "~" for ch in token):  # an HTTP header takes printable ASCII only
        raise AutoparError("--token", "***", "give the token alone, in printable ASCII (a copied token often "
                           "brings a trailing newline or space)", problem="holds whitespace or non-ASCII characters")
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}


def _check_answer(server: str, r, asked: str) -> None:  # noqa: ANN001 - an httpx.Response
    """Stop on a redirect or a server error, each with what to do about it."""
    if 300 <= r.status_code < 400:
        raise AutoparError("--server", server, f"give the URL it redirects to ({r.headers.get('location', '?')}) as "
                           "--server", problem=f"redirects {asked} ({r.status_code})")
    if r.status_code >= 500:
        raise AutoparError("--server", server, "check that the service is up (GET /readyz) and read its log",
                           problem=f"failed {asked} with {r.status_code} ({r.text[:200].strip() or 'no body'})")


def _unreachable(server: str, exc: Exception) -> AutoparError:
    return AutoparError("--server", server, "check the URL and that `autopar serve` is running there",
                        problem=f"could not be reached ({exc})")


def check_writable(server: str, token: str | None, timeout_s: float = 10.0) -> str:
    """Stop with a clear message, before any measuring, if ``server`` is not an autopar service that
    takes writes with ``token``. Returns what it said (``open`` or ``token accepted``)."""
    import httpx

    url = f"{server.rstrip('/')}/v1/auth"
    headers = _headers(token)
    try:
        r = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise _unreachable(server, exc) from None
    _check_answer(server, r, "GET /v1/auth")
    if r.status_code == 401:
        raise AutoparError("--token", None, "pass --token (or set AUTOPAR_TOKEN) to one of the server's AUTOPAR_TOKENS",
                           problem=f"is missing: {server} needs a bearer token for uploads")
    if r.status_code == 403:
        raise AutoparError("--token", "***", "pass one of the server's AUTOPAR_TOKENS",
                           problem=f"is not accepted by {server}")
    try:
        answer = r.json() if r.status_code == 200 else None
    except ValueError:
        answer = None
    writes = answer.get("writes") if isinstance(answer, dict) else None
    if writes is None:
        raise AutoparError("--server", server, "give the base URL of an `autopar serve` (e.g. http://host:8000) "
                           "of this version or later (GET /v1/auth came with it)",
                           problem=f"answered GET /v1/auth with {r.status_code}, not as an autopar service does")
    return str(writes)


def mesh(layout: dict) -> dict[str, int]:
    """The mesh a run is stored against (a layout as JSON): data-parallel, tensor, pipeline and context degrees.
    The service refuses a run whose mesh is not its plan's; ``autopar run`` asks before it trains."""
    return {"dp": layout["dp_replicate"] * layout["dp_shard"], "tp": layout["tp"], "pp": layout["pp"],
            "cp": layout["cp"]}


def check_plan_stored(server: str, plan_id: int, timeout_s: float = 10.0, layout: dict | None = None) -> None:
    """Stop before training if the service holds no plan ``plan_id`` (a run is stored beside it), or one that
    cannot take this run: infeasible, or of another mesh than ``layout`` (the plan about to run, as JSON)."""
    import httpx

    try:
        r = httpx.get(f"{server.rstrip('/')}/v1/plans/{plan_id}", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise _unreachable(server, exc) from None
    if r.status_code == 404:
        raise AutoparError("--plan-id", plan_id,
                           f"give the id of a plan stored there (GET {server.rstrip('/')}/v1/plans)",
                           problem=f"is not a plan stored at {server}")
    if r.status_code != 200:
        raise AutoparError("--server", server, f"the service answered {r.status_code}: {r.text[:300]}",
                           problem=f"did not return plan #{plan_id}")
    stored = (r.json().get("plan") or {}).get("layout")
    if stored is None:
        raise AutoparError("--plan-id", plan_id, "give the id of the plan you are running (its status is 'ok')",
                           problem="is an infeasible plan request at the service (no layout to run)")
    if layout is not None and mesh(stored) != mesh(layout):
        raise AutoparError("--plan-id", plan_id,
                           f"give the id of the plan you are running (this one is {mesh(layout)})",
                           problem=f"is another plan at {server}: mesh {mesh(stored)}")


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
    try:
        answer = r.json()
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise AutoparError("--server", server, "give the base URL of an `autopar serve`; check whether the service "
                           f"stored it (GET {server.rstrip('/')}{path})",
                           problem=f"answered the {what} with {r.status_code} but not with autopar's JSON "
                                   f"({r.text[:120]!r})")
    return answer


def curl_command(server: str, path: str, file: Path, token: str | None) -> str:
    """The shell command that sends ``file`` as ``post_json`` would: the token as ``$AUTOPAR_TOKEN``
    (never its value in a message), exit status non-zero when the service refuses it."""
    auth = " -H \"Authorization: Bearer $AUTOPAR_TOKEN\"" if token else ""
    return (f"curl -sS --fail-with-body -X POST {shlex.quote(server.rstrip('/') + path)} "
            f"-H 'Content-Type: application/json'{auth} --data-binary @{shlex.quote(str(file))}")


def post_or_keep(server: str, path: str, body: bytes, token: str | None, what: str, keep: Path,
                 already_kept: bool = False) -> dict:
    """:func:`post_json`, and if it fails, the body is written to ``keep`` (unless ``already_kept``:
    the caller wrote those very bytes there) and the error says where it is and how to send it."""
    try:
        return post_json(server, path, body, token, what)
    except AutoparError as exc:
        kept = keep if already_kept else unused_path(keep)
        if not already_kept:
            try:
                kept.parent.mkdir(parents=True, exist_ok=True)
                kept.write_bytes(body)
            except OSError as io:
                raise AutoparError(exc.field, exc.value, f"{exc.fix}; and the {what} could not be kept in {kept} "
                                   f"({io.strerror}): it is lost", problem=exc.problem) from None
        with_token = ", with AUTOPAR_TOKEN set to the token" if token else ""
        raise AutoparError(exc.field, exc.value, f"{exc.fix}. Nothing is lost: the {what} is kept in {kept}; send it "
                           f"once the service takes it{with_token}: {curl_command(server, path, kept, token)}",
                           problem=exc.problem) from None
