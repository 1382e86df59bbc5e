"""planner.client against a real `autopar serve`: uploaders learn of a wrong server or token before
they measure, and an upload refused after the work keeps it in a file with a command that sends it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from planner.client import check_plan_stored, check_writable, post_or_keep
from planner.errors import AutoparError
from planner.reference import reference_profile

AUTOPAR = str(Path(sys.executable).parent / "autopar")


def _profile_bytes(name: str) -> bytes:
    body = reference_profile("dgx-h100", 1).model_dump(mode="json")
    body.update(name=name, kind="measured")
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # noqa: ANN201
    from conftest import LiveServer

    tmp = tmp_path_factory.mktemp("client")
    with LiveServer(f"sqlite:///{tmp}/c.db", AUTOPAR_TOKENS="s3cret", AUTOPAR_LOAD_REFERENCE="0") as live:
        yield live


def test_the_server_and_token_are_checked_before_any_work(server, tmp_path: Path) -> None:  # noqa: ANN001
    from conftest import free_port

    assert check_writable(server.url, "s3cret") == "token accepted"
    with pytest.raises(AutoparError) as missing:
        check_writable(server.url, None)
    assert missing.value.field == "--token" and "needs a bearer token" in str(missing.value)
    with pytest.raises(AutoparError) as wrong:
        check_writable(server.url + "/", "nope")
    assert wrong.value.field == "--token" and "not accepted" in str(wrong.value) and "nope" not in str(wrong.value)
    with pytest.raises(AutoparError) as gone:
        check_writable(f"http://127.0.0.1:{free_port()}", "s3cret")
    assert gone.value.field == "--server" and "could not be reached" in str(gone.value)
    with pytest.raises(AutoparError) as other:  # something answers, but not as autopar does
        check_writable(f"{server.url}/v1/presets", "s3cret")
    assert other.value.field == "--server" and "not as an autopar service does" in str(other.value)
    with pytest.raises(AutoparError) as no_plan:
        check_plan_stored(server.url, 4242)
    assert no_plan.value.field == "--plan-id" and "is not a plan stored at" in str(no_plan.value)
    # a stored plan of another mesh than the one about to run: refused before training, not after
    import httpx
    from test_api import measured

    auth = {"Authorization": "Bearer s3cret"}
    profile = httpx.post(f"{server.url}/v1/profiles", headers=auth, timeout=60, json=measured("plan-id-lab")).json()
    stored = httpx.post(f"{server.url}/v1/plans", headers=auth, timeout=60, json={
        "model": {"preset": "llama3-8b"}, "training": {"seq_length": 2048, "global_batch_size": 16},
        "profile_id": profile["id"]}).json()
    lay = stored["plan"]["layout"]
    check_plan_stored(server.url, stored["id"], layout=lay)  # its own layout: accepted
    other = {**lay, "tp": lay["tp"] * 2 if lay["tp"] < 8 else 1}
    with pytest.raises(AutoparError) as wrong_plan:
        check_plan_stored(server.url, stored["id"], layout=other)
    assert wrong_plan.value.field == "--plan-id" and "is another plan at" in str(wrong_plan.value)

    # autopar profile stops on the token before it measures anything, and writes nothing
    t0 = time.perf_counter()
    out = tmp_path / "p.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "AUTOPAR_TOKEN")}
    r = subprocess.run([AUTOPAR, "profile", "--quick", "--out", str(out), "--server", server.url, "--token", "nope"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "--token" in r.stderr and "not accepted" in r.stderr, r.stderr
    assert "compute" not in r.stderr and "Traceback" not in r.stderr and not out.exists()
    assert time.perf_counter() - t0 < 60


def test_a_refused_upload_keeps_the_body_and_says_how_to_send_it(server, tmp_path: Path) -> None:  # noqa: ANN001
    body = _profile_bytes("kept-lab")
    keep = tmp_path / "sub" / "kept.json"
    with pytest.raises(AutoparError) as refused:
        post_or_keep(server.url, "/v1/profiles", body, "nope", "profile", keep)
    text = str(refused.value)
    assert "refused the profile" in text and "403" in text and f"kept in {keep}" in text and "nope" not in text
    assert keep.read_bytes() == body
    assert httpx.get(f"{server.url}/v1/profiles", params={"cluster": "kept-lab"}).json()["total"] == 0
    # the command in the message sends it, with the token from the environment
    command = text.split("with AUTOPAR_TOKEN set to the token: ", 1)[1]
    sent = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "AUTOPAR_TOKEN": "s3cret"})
    assert sent.returncode == 0 and json.loads(sent.stdout)["created"] is True, sent.stdout + sent.stderr
    listed = httpx.get(f"{server.url}/v1/profiles", params={"cluster": "kept-lab"}).json()
    assert listed["total"] == 1 and listed["items"][0]["cluster"] == "kept-lab"
    # a file the caller already wrote is named, not written again
    mine = tmp_path / "mine.json"
    mine.write_bytes(b"{}")
    with pytest.raises(AutoparError) as again:
        post_or_keep(server.url, "/v1/profiles", body, None, "profile", mine, already_kept=True)
    assert f"kept in {mine}" in str(again.value) and mine.read_bytes() == b"{}"
    # accepted: the service's answer
    assert post_or_keep(server.url, "/v1/profiles", body, "s3cret", "profile", tmp_path / "unused.json")["id"] >= 1
    assert not (tmp_path / "unused.json").exists()


def test_a_profile_whose_upload_fails_after_measuring_is_kept_here(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`autopar profile --server` without --out, the service gone by the end: the profile stays in the
    working directory, byte for byte what would have been sent."""
    from conftest import free_port

    from profiler.cli import publish

    monkeypatch.chdir(tmp_path)
    text = _profile_bytes("late-lab").decode()
    with pytest.raises(AutoparError) as gone:
        publish(text, None, f"http://127.0.0.1:{free_port()}", "tok")
    (kept,) = tmp_path.glob("autopar-profile-*.json")
    assert (
        kept.read_text() == text and f"kept in {kept}" in str(gone.value) and "could not be reached" in str(gone.value)
    )
    # with --out the profile is there already, and is the file named
    out = tmp_path / "o" / "p.json"
    with pytest.raises(AutoparError) as again:
        publish(text, out, f"http://127.0.0.1:{free_port()}", None)
    assert out.read_text() == text and f"kept in {out}" in str(again.value)
    assert len(list(tmp_path.glob("autopar-profile-*.json"))) == 1


def test_a_profile_whose_out_fails_after_an_upload_is_kept_and_names_the_stored_profile(
    server, tmp_path: Path, monkeypatch
) -> None:  # noqa: ANN001
    """--out went bad while measuring (its folder is now a file), the upload still works: the profile is
    stored, kept here as well, and the error names --out, the kept file and the stored profile's id."""
    from profiler.cli import publish

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    text = _profile_bytes("out-gone-lab").decode()
    with pytest.raises(AutoparError) as err:
        publish(text, tmp_path / "afile" / "p.json", server.url, "s3cret")
    (kept,) = tmp_path.glob("autopar-profile-*.json")
    stored = [p for p in httpx.get(f"{server.url}/v1/profiles").json()["items"] if p["cluster"] == "out-gone-lab"]
    assert len(stored) == 1 and kept.read_text() == text
    message = str(err.value)
    assert message.startswith("--out=") and f"the profile is kept in {kept}" in message
    assert f"the service stored it as profile #{stored[0]['id']}" in message


class _Canned:
    """A real HTTP server on loopback answering every request with one canned status, body and headers
    (what a proxy, an old server or another program might say)."""

    def __init__(self) -> None:
        import http.server
        import threading

        canned = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(canned.status)
                for k, v in canned.headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(canned.body)))
                self.end_headers()
                self.wfile.write(canned.body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:  # noqa: ANN002
                pass

        self.status, self.body, self.headers = 200, b"", {}
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def says(self, status: int, body: bytes = b"", **headers: str) -> _Canned:
        self.status, self.body, self.headers = status, body, headers
        return self


@pytest.fixture()
def canned():  # noqa: ANN201
    c = _Canned()
    yield c
    c.httpd.shutdown()


def test_odd_answers_and_tokens_get_clear_errors_and_keep_the_body(canned, tmp_path: Path) -> None:  # noqa: ANN001
    def error(fn, *args) -> AutoparError:  # noqa: ANN001, ANN002
        with pytest.raises(AutoparError) as caught:
            fn(*args)
        return caught.value

    e = error(check_writable, canned.says(502, b"Bad Gateway").url, "tok")
    assert e.field == "--server" and "failed GET /v1/auth with 502 (Bad Gateway)" in str(e) and "/readyz" in str(e)
    e = error(check_writable, canned.says(308, location="https://svc.example/").url, "tok")
    assert e.field == "--server" and "redirects GET /v1/auth (308)" in str(e) and "https://svc.example/" in str(e)
    for body in (b"[1, 2]", b'"ok"', b"<html>hello</html>", b"{}"):
        e = error(check_writable, canned.says(200, body).url, None)
        assert e.field == "--server" and "not as an autopar service does" in str(e), body
    # a token with a line break or outside ASCII: named as the token's fault, its value never shown
    for token in ("secret\n", "s3cr\u00e9t", "two words"):
        e = error(check_writable, canned.says(200, b'{"writes": "open"}').url, token)
        assert e.field == "--token" and "printable ASCII" in str(e) and token.strip() not in str(e), token
    # an upload answered 201 without JSON (a proxy's page, say) is not taken as stored: the body is kept
    body = _profile_bytes("odd-lab")
    keep = tmp_path / "kept.json"
    e = error(post_or_keep, canned.says(201, b"<html>ok</html>").url, "/v1/profiles", body, None, "profile", keep)
    assert "not with autopar's JSON" in str(e) and f"kept in {keep}" in str(e) and keep.read_bytes() == body
    # a second failure never overwrites the first kept body, nor any other file
    e = error(post_or_keep, canned.says(503).url, "/v1/profiles", b"{}", None, "profile", keep)
    second = tmp_path / "kept-2.json"
    assert f"kept in {second}" in str(e) and second.read_bytes() == b"{}" and keep.read_bytes() == body
    assert "refused the profile" in str(e) and "--fail-with-body" in str(e) and "AUTOPAR_TOKEN" not in str(e)
    # the token's own fault after the work: still kept
    e = error(post_or_keep, canned.url, "/v1/profiles", body, "bad\ttoken", "profile", tmp_path / "t.json")
    assert e.field == "--token" and (tmp_path / "t.json").read_bytes() == body
