#!/usr/bin/env python3
"""Bad input, each answered at once: sizes beyond any job, NaN and Infinity, ``true`` for a count,
and plans this host cannot run.

    .venv/bin/python benchmarks/bad_input.py

The service part starts ``api.app:create_app`` under uvicorn on a fresh SQLite file and sends every
request over one keep-alive connection (httpx.Client), a good plan request after each bad one: a bad
request that crashed the server used to reset the connection the next request came on. The command
line part runs ``autopar plan`` and ``autopar run`` in subprocesses (``autopar run`` with
``AUTOPAR_FORCE_CPU=1``: the CPU ranks' host check). Each line shows the input, the status or exit
code, the wall time, and PASS where it was answered 4xx (service) or exit 2 (command line) within
1 s. Exit status 1 if any line is not PASS, or the connection was not kept. (The command lines'
times include starting Python; ``autopar run``'s include importing torch, ~1 s here, which it needs
to check the plan before anything else.)

Before (issue 23): ``global_batch_size = 10^30`` held a core in trial division for minutes; NaN or
Infinity anywhere in a body answered 500 and reset the connection; ``seq_length: true`` was stored
as 1; ``autopar run`` of a 16-GPU plan on a 2-core host started 16 workers until the OOM killer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from api_load import listening_socket, serve_on  # noqa: E402  (benchmarks/)

LIMIT_S = 1.0
HUGE = 10**30
TRAINING = {"seq_length": 4096, "global_batch_size": 64}
GOOD = {"model": {"preset": "llama3-8b"}, "training": TRAINING, "cluster": "dgx-h100", "options": {"time_budget_s": 5}}
SPEC = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "vocab_size": 256}


def plan_body(**change: object) -> str:
    return json.dumps({**GOOD, **change})


def with_literal(body: dict, marker: float, literal: str) -> str:
    """``body`` as JSON with ``marker`` written as ``literal`` (NaN, Infinity, 1e999: no JSON encoder writes them)."""
    return json.dumps(body).replace(json.dumps(marker), literal)


M = 12345.678  # marker
SERVICE = [  # (what, path, raw body)
    ("global_batch_size 10^30", "/v1/plans", plan_body(training={"seq_length": 4096, "global_batch_size": HUGE})),
    ("global_batch_tokens 10^30", "/v1/plans", plan_body(training={"seq_length": 4096, "global_batch_tokens": HUGE})),
    ("seq_length 10^30", "/v1/plans", plan_body(training={"seq_length": HUGE, "global_batch_size": 64})),
    ("num_nodes 10^30", "/v1/plans", plan_body(num_nodes=HUGE)),
    ("num_nodes 2^20 (8 GPUs each)", "/v1/plans", plan_body(num_nodes=2**20)),
    ("options.max_micro_batch_size 10^30", "/v1/plans", plan_body(options={"max_micro_batch_size": HUGE})),
    ("options.max_pp 10^30", "/v1/plans", plan_body(options={"max_pp": HUGE})),
    ("options.time_budget_s 1e300", "/v1/plans", plan_body(options={"time_budget_s": 1e300})),
    ("model.spec.vocab_size 10^30", "/v1/plans", plan_body(model={"spec": {**SPEC, "vocab_size": HUGE}})),
    ("training.moe_load_imbalance NaN", "/v1/plans",
     with_literal({**GOOD, "training": {**TRAINING, "moe_load_imbalance": M}}, M, "NaN")),
    ("options.time_budget_s Infinity", "/v1/plans",
     with_literal({**GOOD, "options": {"time_budget_s": M}}, M, "Infinity")),
    ("options.memory_headroom -Infinity", "/v1/plans",
     with_literal({**GOOD, "options": {"memory_headroom": M}}, M, "-Infinity")),
    ("model.hf_config.rope_theta 1e999", "/v1/plans",
     with_literal({**GOOD, "model": {"hf_config": {"model_type": "llama", "rope_theta": M}}}, M, "1e999")),
    ("runs: report.steps.0.loss NaN", "/v1/runs",
     with_literal({"plan_id": 1, "report": {"steps": [{"step": 0, "loss": M, "time_s": 1.0}]}}, M, "NaN")),
    ("profiles: device.peak_tflops.bf16 Infinity", "/v1/profiles",
     with_literal({"name": "x", "device": {"peak_tflops": {"bf16": M}}}, M, "Infinity")),
    ("the whole body NaN", "/v1/plans", "NaN"),
    ("seq_length true", "/v1/plans", plan_body(training={"seq_length": True, "global_batch_size": 64})),
    ("global_batch_size \"64\"", "/v1/plans", plan_body(training={"seq_length": 4096, "global_batch_size": "64"})),
    ("num_nodes true", "/v1/plans", plan_body(num_nodes=True)),
    ("options.top_k true", "/v1/plans", plan_body(options={"top_k": True})),
    ("options.zero_stages [true]", "/v1/plans", plan_body(options={"zero_stages": [True]})),
]

CLI_PLAN = [  # autopar plan --model llama3-8b ...
    ("--global-batch", str(HUGE)), ("--global-batch-tokens", str(HUGE)), ("--global-batch", "64", "--seq", str(HUGE)),
    ("--global-batch", "64", "--nodes", str(HUGE)), ("--global-batch", "64", "--time-budget", "inf"),
    ("--global-batch", "64", "--time-budget", "nan"), ("--global-batch", "64", "--max-micro-batch", str(HUGE)),
]


def _no_constant(literal: str) -> None:
    raise ValueError(f"holds {literal}")


def verdict(ok: bool, wall: float) -> str:
    return "PASS" if ok and wall <= LIMIT_S else ("FAIL (slow)" if ok else "FAIL")


def row(what: str, answer: str, wall: float, result: str, detail: str) -> None:
    print(f"{result:<11} {answer:>6} {wall * 1e3:8.0f} ms  {what:<58} {detail[:150]}", flush=True)


def service() -> list[str]:
    """Every bad body over one connection, each followed by a good request on it."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        sock = listening_socket()
        env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp}/bad.db", "PYTHONPATH": str(REPO)}
        log = open(Path(tmp) / "server.log", "w+")  # noqa: SIM115
        port = sock.getsockname()[1]
        proc = serve_on(sock, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        sock.close()  # the server holds its own copy
        try:
            base = _ready(proc, port)
            with httpx.Client(base_url=base, timeout=120, limits=httpx.Limits(max_connections=1)) as client:
                ports: set = set()
                for what, path, body in SERVICE:
                    results += send_bad_then_good(client, what, path, body, ports)
                kept = len(ports) == 1
                print(f"{'PASS' if kept else 'FAIL':<11} one keep-alive connection carried all {2 * len(SERVICE)} "
                      f"requests (client ports seen: {sorted(p[1] for p in ports)})")
                results.append("PASS" if kept else "FAIL")
        finally:
            proc.terminate()
            proc.wait(10)
            log.seek(0)
            text = log.read()
            log.close()
        if "Traceback" in text:
            print("FAIL        the server logged a traceback:\n" + text[-2000:])
            results.append("FAIL")
    return results


def send_bad_then_good(client: httpx.Client, what: str, path: str, body: str, ports: set) -> list[str]:
    """POST the bad body (its line printed), then a good plan request on the same client; the client
    ports each used go into ``ports``."""
    t0 = time.perf_counter()
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    wall = time.perf_counter() - t0
    try:
        answer = json.loads(r.text, parse_constant=_no_constant)
        detail = answer["detail"][0]["msg"] if r.status_code == 422 else r.text
    except ValueError as exc:
        detail = f"response is not JSON: {exc}"
    result = verdict(400 <= r.status_code < 500 and "not JSON" not in detail, wall)
    row(f"POST {path} {what}", str(r.status_code), wall, result, detail)
    good = client.post("/v1/plans", json=GOOD)
    ports.update(x.extensions["network_stream"].get_extra_info("client_addr") for x in (r, good))
    return [result] + ([] if good.status_code == 201 else [f"FAIL: the good request after it got {good.status_code}"])


def _ready(proc: subprocess.Popen, port: int) -> str:
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return base
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit("the server did not become ready")


def autopar(*args: str, env: dict | None = None) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", "from planner.cli import main; main()", *args], capture_output=True,
                       text=True, timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    text = (r.stderr.strip() or r.stdout.strip()).splitlines()
    return r.returncode, text[-1] if text else "", time.perf_counter() - t0


def command_line() -> list[str]:
    results = []
    for args in CLI_PLAN:
        code, out, wall = autopar("plan", "--model", "llama3-8b", *args)
        result = verdict(code == 2, wall)
        row("autopar plan --model llama3-8b " + " ".join(args), str(code), wall, result, out)
        results.append(result)
    with tempfile.TemporaryDirectory() as tmp:
        plan16 = Path(tmp) / "llama3-8b-16.json"
        code, out, wall = autopar("plan", "--model", "llama3-8b", "--nodes", "2", "--global-batch", "64",
                                  "--time-budget", "5", "--out", str(plan16))
        print(f"{'':<11} {code:>6} {wall * 1e3:8.0f} ms  (made {plan16.name}: "
              "`autopar plan --model llama3-8b --nodes 2 --global-batch 64`, 16 ranks)")
        cpu = {"AUTOPAR_FORCE_CPU": "1"}
        for args in ((str(plan16), "--dry-run"), (str(plan16), "--steps", "1")):
            code, out, wall = autopar("run", *args, env=cpu)
            result = verdict(code == 2 and "starting" not in out, wall)
            row("AUTOPAR_FORCE_CPU=1 autopar run " + " ".join(a.replace(tmp + "/", "") for a in args), str(code), wall,
                result, out)
            results.append(result)
    return results


def main() -> int:
    print(f"{'verdict':<11} {'answer':>6} {'wall':>11}  input")
    results = service() + command_line()
    bad = [r for r in results if r != "PASS"]
    print(f"\n{len(results) - len(bad)} of {len(results)} PASS (answered 4xx / exit 2 within {LIMIT_S:g} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
