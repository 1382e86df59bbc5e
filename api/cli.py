"""``autopar serve``: migrate the database, load the reference profiles, serve the API and the pages."""

from __future__ import annotations

import threading
import time
from typing import Annotated

import typer
from rich.console import Console

from api.settings import Settings

console = Console(soft_wrap=True)  # URLs and the curl line stay copy-pasteable

# idle keep-alive longer than clients' and load balancers' own (httpx 5 s, ALB 60 s): a server that
# closes an idle connection first races the client's next request on it (seen once as ReadError)
KEEP_ALIVE_S = 65

EXAMPLE_PLAN = {
    "model": {"preset": "llama3.1-70b"},
    "training": {"seq_length": 8192, "global_batch_size": 256},
    "cluster": "dgx-h100",
    "num_nodes": 8,
    "options": {"top_k": 3},
}


def _post_example(base: str, tokens: tuple[str, ...]) -> None:
    """Wait for /readyz, POST the example plan, print where to look."""
    import httpx

    headers = {"Authorization": f"Bearer {tokens[0]}"} if tokens else {}
    for _ in range(300):
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        console.print("[red]the server did not become ready in 60 s; no example plan posted[/]")
        return
    # one key for the example: a restart answers with the plan stored before instead of storing another
    from api.store import canonical_hash

    key = {"Idempotency-Key": f"autopar-example-{canonical_hash(EXAMPLE_PLAN)[:16]}"}
    r = httpx.post(f"{base}/v1/plans", json=EXAMPLE_PLAN, headers={**headers, **key}, timeout=120)
    if r.status_code not in (200, 201):
        console.print(f"[red]example plan failed: {r.status_code} {r.text[:500]}[/]")
        return
    body = r.json()
    lay = body["plan"]["layout"] if body.get("plan") else None
    console.rule("autopar is serving")
    if lay:
        pred = body["plan"]["prediction"]
        console.print(f"example plan #{body['id']}: {body['model_name']} on {body['num_gpus']} GPUs "
                      f"({body['cluster']}): "
                      f"tp={lay['tp']} pp={lay['pp']} cp={lay['cp']} dp={lay['dp_replicate'] * lay['dp_shard']} "
                      f"zero={lay['zero_stage']} mb={lay['micro_batch_size']} {lay['schedule']} -> step "
                      f"{pred['step_time_s']:.3f} s, MFU {pred['mfu']:.1%}")
    console.print(f"  pages:     {base}/            (clusters, profiles, plans, runs)")
    console.print(f"  this plan: {base}/plans/{body['id']}")
    console.print(f"  API docs:  {base}/docs")
    console.print(f"  plan with curl:\n    curl -s -X POST {base}/v1/plans -H 'Content-Type: application/json' \\\n"
                  "      -d '{\"model\": {\"preset\": \"llama3-8b\"}, \"training\": {\"seq_length\": 4096, "
                  "\"global_batch_size\": 64}, \"cluster\": \"dgx-h100\", \"num_nodes\": 2}'")
    if tokens:
        console.print("  writes need a bearer token: add -H 'Authorization: Bearer <one of AUTOPAR_TOKENS>'")
    else:
        console.print("  writes are open: start with AUTOPAR_TOKENS=tok1,tok2 to require 'Authorization: Bearer tok1'")
    console.print("  Ctrl-C stops the server")


def _port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served on (None: it can), checked by binding it as uvicorn will
    (SO_REUSEADDR, so a port in TIME_WAIT after a restart counts as free)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"--host {host!r} does not resolve ({exc.strerror}): give an address such as 127.0.0.1 or 0.0.0.0"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return (f"--port {port}: {host}:{port} cannot be listened on ({exc.strerror}); another server may "
                    f"hold it: stop it, or pick a free port with --port (make run PORT=8001)")
    return None


def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    database_url: Annotated[str | None,
                            typer.Option(help="overrides DATABASE_URL (default sqlite:///autopar.db)")] = None,
    example: Annotated[bool, typer.Option(help="post one example plan once ready and print the URLs")] = False,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes")] = 1,
) -> None:
    """Serve the autopar API (/v1, docs at /docs) and pages (/): migrates the database and loads reference profiles."""
    import uvicorn

    from api.app import create_app
    from api.db import Database
    from api.migrate import migrate
    from api.store import load_reference_profiles

    why = _port_taken(host, port)
    if why:  # before migrating, and before the example would be posted to whatever holds the port
        raise typer.BadParameter(why)
    settings = Settings.from_env()
    if database_url:
        settings = Settings(**{**settings.__dict__, "database_url": database_url})
    db = Database(settings.database_url)
    migrate(db.engine)
    loaded = load_reference_profiles(db) if settings.load_reference else []
    new = sum(1 for u in loaded if u.created)
    measured = sum(1 for u in loaded if u.entry.profile.kind == "measured")
    console.print(f"database {db.engine.url.render_as_string(hide_password=True)}: migrated; "
                  f"{len(loaded) - measured} reference profiles and {measured} measured ({new} new)")
    db.dispose()
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    if example:
        threading.Thread(target=_post_example, args=(base, settings.tokens), daemon=True).start()
    if workers > 1:
        import os

        from api.settings import default_plan_workers

        os.environ["DATABASE_URL"] = settings.database_url
        # the machine's cores shared by the workers' plan searches
        os.environ.setdefault("AUTOPAR_PLAN_WORKERS", str(default_plan_workers(workers)))
        uvicorn.run("api.app:create_app", factory=True, host=host, port=port, workers=workers, log_level="warning",
                    timeout_keep_alive=KEEP_ALIVE_S)
    else:
        uvicorn.run(create_app(settings), host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
