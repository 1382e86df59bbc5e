"""``autopar run PLAN.json``: check the plan, launch torchrun with the executor's worker, show the RunReport.

Everything the executor would refuse is refused here, before a process starts (the plan's mesh,
the layout dimensions the executor implements, the model, the micro-batch split, the pipeline
schedule, an HF config that does not match the plan's model). Then ``torch.distributed.run``
starts ``plan.num_gpus`` workers (``python -m executor.train``) on this node — or
``--nproc-per-node`` on each of ``--nnodes`` nodes — and rank 0 writes the RunReport, which is
printed, written to ``--out`` and, with ``--server``, stored by the service beside the plan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from planner.contracts import Plan, RunReport
from planner.errors import AutoparError
from planner.files import check_out

err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
console = Console(width=None if sys.stdout.isatty() else 200)
GiB = 2**30


def load_plan(path: Path) -> Plan:
    """The Plan in ``path``; a missing file or an invalid plan is an AutoparError naming the field."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise AutoparError("PLAN.json", str(path), "give the path of a Plan written by `autopar plan --out`",
                           problem=f"cannot be read ({exc.strerror})") from None
    try:
        return Plan.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "plan"
        raise AutoparError(f"plan.{loc}", first.get("input") if not isinstance(first.get("input"), dict) else "...",
                           "write the plan with `autopar plan --out PLAN.json`",
                           problem=f"is not a valid Plan ({first['msg']}; {len(exc.errors())} problem(s))") from None


def load_hf_config(path: Path | None, plan: Plan) -> dict | None:
    """The HF config.json, checked against the plan's model (same shape, or the run is not the plan)."""
    if path is None:
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AutoparError("--hf-config", str(path), "give a readable Hugging Face config.json",
                           problem=f"cannot be read as JSON ({exc})") from None
    from planner.hf_config import model_spec_from_hf_config

    spec = model_spec_from_hf_config(path)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "kv_heads", "vocab_size", "ffn_hidden_size"):
        if getattr(spec, name) != getattr(plan.model, name):
            raise AutoparError("--hf-config", str(path), "plan for this config (`autopar plan --hf-config ...`)",
                               problem=f"has {name}={getattr(spec, name)} but the plan's model has "
                                       f"{getattr(plan.model, name)}")
    return config


def worker_command(plan_path: Path, *, nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str | None,
                   master_port: int, max_restarts: int, worker_args: list[str]) -> list[str]:
    """The torchrun command line: ``--standalone`` on one node, static rendezvous across nodes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node),
           "--max-restarts", str(max_restarts)]
    if nnodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", master_addr or "127.0.0.1",
                "--master-port", str(master_port)]
    return cmd + ["-m", "executor.train", "--plan", str(plan_path), *worker_args]


def render_report(report: RunReport, plan: Plan) -> None:
    """Measured against predicted: step time, tokens/s, MFU, peak memory; the loss curve's ends."""
    pred = plan.prediction
    table = Table(title=f"run of {plan.model.name} on {report.num_ranks} rank(s), {report.device}")
    table.add_column("")
    table.add_column("measured", justify="right")
    table.add_column("predicted", justify="right")
    peak = max(report.peak_memory_bytes_per_rank)
    table.add_row("step time", f"{report.median_step_time_s * 1e3:.1f} ms", f"{pred.step_time_s * 1e3:.1f} ms")
    table.add_row("tokens/s", f"{report.tokens_per_s:,.0f}", f"{pred.tokens_per_s:,.0f}")
    table.add_row("MFU", "n/a (no peak: pass --profile)" if report.mfu is None else f"{report.mfu:.1%}",
                  f"{pred.mfu:.1%}")
    table.add_row(f"peak memory/rank ({report.memory_kind})", f"{peak / GiB:.2f} GiB",
                  f"{pred.memory.total_bytes / GiB:.2f} GiB")
    console.print(table)
    if report.steps:
        first, last = report.steps[0], report.steps[-1]
        console.print(f"loss {first.loss:.4f} (step {first.step}) -> {last.loss:.4f} (step {last.step}); "
                      f"median over {len(report.steps) - report.warmup_steps} step(s) after {report.warmup_steps} warm-up")


def upload(report: RunReport, server: str, token: str | None, plan_id: int, keep: Path) -> dict:
    """POST the report to ``{server}/v1/runs`` for the stored plan ``plan_id``; if that fails, the
    request body is kept in ``keep`` and the error says how to send it."""
    from planner.client import post_or_keep

    body = {"plan_id": plan_id, "report": json.loads(report.model_dump_json())}
    body["report"]["plan_id"] = str(plan_id)
    return post_or_keep(server, "/v1/runs", json.dumps(body).encode(), token, "run", keep)


def run(
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN.json", help="a Plan written by `autopar plan --out`")],
    steps: Annotated[int, typer.Option(min=1, help="optimizer steps to run (counted from step 0)")] = 20,
    warmup: Annotated[int, typer.Option(min=0, help="first steps left out of the median step time")] = 3,
    seed: Annotated[int, typer.Option(help="weights and synthetic data seed")] = 0,
    lr: Annotated[float, typer.Option(min=0.0, help="AdamW learning rate")] = 1e-3,
    checkpoint_dir: Annotated[Path | None, typer.Option(help="save DCP checkpoints here (step_<N>/)")] = None,
    checkpoint_every: Annotated[int, typer.Option(min=0, help="save every K steps (0: never)")] = 0,
    async_checkpoint: Annotated[bool, typer.Option(help="save with dcp.async_save (overlaps the next steps)")] = False,
    resume: Annotated[bool, typer.Option(help="continue from the newest checkpoint in --checkpoint-dir (any plan)")] = False,
    data: Annotated[Path | None, typer.Option(help="flat uint16/uint32 token file (default: synthetic tokens)")] = None,
    hf_config: Annotated[Path | None, typer.Option(help="train a Hugging Face model of this config.json "
                                                             "(random weights) instead of the built-in one")] = None,
    profile: Annotated[Path | None, typer.Option(help="ClusterProfile JSON: the peak the MFU is measured against")] = None,
    out: Annotated[Path | None, typer.Option(help="write the RunReport JSON here")] = None,
    server: Annotated[str | None, typer.Option(help="POST the report to {server}/v1/runs")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token for --server", envvar="AUTOPAR_TOKEN")] = None,
    plan_id: Annotated[int | None, typer.Option(min=1, help="the service's id of this plan (with --server)")] = None,
    nnodes: Annotated[int, typer.Option(min=1, help="nodes of a multi-node run (start `autopar run` on each)")] = 1,
    node_rank: Annotated[int, typer.Option(min=0, help="this node's rank in a multi-node run")] = 0,
    nproc_per_node: Annotated[int | None, typer.Option(min=1, help="workers per node (default plan.num_gpus / "
                                                                        "--nnodes)")] = None,
    master_addr: Annotated[str | None, typer.Option(help="address of node 0 (multi-node)")] = None,
    master_port: Annotated[int, typer.Option(min=1, max=65535, help="port on node 0 (multi-node)")] = 29500,
    max_restarts: Annotated[int, typer.Option(min=0, help="restart all workers this often after a failure; they "
                                                            "resume from the newest checkpoint")] = 0,
) -> None:
    """Train with a plan under torchrun and report measured step time, tokens/s, MFU and memory.

      autopar run plan.json --steps 50 --out report.json

      autopar run plan.json --checkpoint-dir ckpt --checkpoint-every 10 --max-restarts 2

      autopar run plan.json --nnodes 2 --node-rank 0 --master-addr node0 --nproc-per-node 8
    """
    from executor.train import check_plan

    try:
        plan = load_plan(plan_file)
        config = load_hf_config(hf_config, plan)
        check_plan(plan, hf_config=config)
        nproc = nproc_per_node or plan.num_gpus // nnodes
        if nproc * nnodes != plan.num_gpus:
            raise AutoparError("--nproc-per-node", nproc, f"use nnodes x nproc-per-node = plan.num_gpus = {plan.num_gpus}",
                               problem=f"x --nnodes {nnodes} = {nproc * nnodes} workers")
        if node_rank >= nnodes:
            raise AutoparError("--node-rank", node_rank, f"use 0..{nnodes - 1}", problem=f"is not below --nnodes {nnodes}")
        if server and plan_id is None:
            raise AutoparError("--plan-id", None, "give the service's id of this plan (GET /v1/plans)",
                               problem="is missing; the service stores a run beside its plan")
        if checkpoint_every and checkpoint_dir is None:
            raise AutoparError("--checkpoint-every", checkpoint_every, "also give --checkpoint-dir DIR",
                               problem="has nowhere to save")
        if resume and checkpoint_dir is None:
            raise AutoparError("--resume", True, "give --checkpoint-dir DIR", problem="has no checkpoint to resume from")
        if checkpoint_dir is not None and not resume:
            from executor.checkpoint import latest_step

            found = latest_step(checkpoint_dir)
            if found is not None:
                raise AutoparError("--checkpoint-dir", str(checkpoint_dir), "pass --resume to continue from it, or use "
                                   "an empty directory", problem=f"already holds a checkpoint of step {found}")
        for flag, path in (("--data", data), ("--profile", profile)):
            if path is not None and not path.is_file():
                raise AutoparError(flag, str(path), "give an existing file", problem="does not exist")
        if out is not None and node_rank == 0:  # node 0's rank 0 writes the report: refused before training
            check_out(out, "report.json")
        if server and node_rank == 0:  # node 0 uploads: asked before the workers start, not after training
            from planner.client import check_plan_stored, check_writable

            check_writable(server, token)
            check_plan_stored(server, plan_id)
    except AutoparError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None

    report_path = out or Path(tempfile.mkdtemp(prefix="autopar-run-")) / "report.json"
    report_path.unlink(missing_ok=True)
    args = ["--steps", str(steps), "--warmup", str(warmup), "--seed", str(seed), "--lr", str(lr),
            "--out", str(report_path.resolve())]
    for flag, value in (("--checkpoint-dir", checkpoint_dir), ("--data", data), ("--hf-config", hf_config),
                        ("--profile", profile)):
        if value is not None:
            args += [flag, str(Path(value).resolve())]
    if checkpoint_every:
        args += ["--checkpoint-every", str(checkpoint_every)]
    if async_checkpoint:
        args.append("--async-checkpoint")
    if resume:
        args.append("--resume")
    if plan_id is not None:
        args += ["--plan-id", str(plan_id)]
    cmd = worker_command(plan_file.resolve(), nproc_per_node=nproc, nnodes=nnodes, node_rank=node_rank,
                         master_addr=master_addr, master_port=master_port, max_restarts=max_restarts,
                         worker_args=args)
    layout = plan.layout
    err.print(f"starting {nproc} worker(s) x {nnodes} node(s): pp={layout.pp} dp={layout.dp_replicate}x{layout.dp_shard} "
              f"cp={layout.cp} tp={layout.tp}{' sp' if layout.sp else ''} ep={layout.ep} zero={layout.zero_stage} "
              f"micro-batch {layout.micro_batch_size}, {steps} steps")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                   os.environ.get("PYTHONPATH")]))}
    code = subprocess.call(cmd, env=env)
    if code != 0:
        err.print(f"[bold red]error:[/] the workers failed (torchrun exit status {code}); see their output above")
        raise typer.Exit(1)
    if not report_path.is_file():
        if nnodes == 1:  # rank 0 ran here and wrote none: its error above names where the report was kept
            err.print(f"[bold red]error:[/] no run report at {report_path}; see the workers' output above")
            raise typer.Exit(1)
        err.print(f"node {node_rank} done (rank 0 writes the report on node 0)")
        return
    report = RunReport.model_validate_json(report_path.read_text())
    render_report(report, plan)
    if out is not None:
        err.print(f"report written to {out}")
    if server:
        try:
            stored = upload(report, server, token, plan_id,
                            report_path.parent / f"run-of-plan-{plan_id}-{time.strftime('%Y%m%d-%H%M%S')}.json")
        except AutoparError as exc:
            err.print(f"[bold red]error:[/] {exc}", highlight=False)
            raise typer.Exit(2) from None
        err.print(f"stored as run #{stored.get('id')} of plan #{plan_id} at {server}")
