"""``autopar run PLAN.json``: check the plan, launch torchrun with the executor's worker, show the RunReport.

Everything the executor would refuse is refused here, before a process starts (the plan's mesh,
the layout dimensions the executor implements, the model, the micro-batch split, the pipeline
schedule, an HF config that does not match the plan's model), and so is bad input the workers would
find only after starting or after training (a --profile that is no ClusterProfile, a --data file that
is no flat token file of the plan's vocabulary, a --checkpoint-dir or --out that cannot be written, a
learning rate that is not finite or absurd, options that would be silently ignored), and a host that
cannot hold the ranks (too few CUDA GPUs or too little memory on them; for CPU ranks, too few cores or
too little host memory: :func:`check_host`). ``--dry-run`` stops there, exit 0. Then
``torch.distributed.run`` starts ``plan.num_gpus`` workers (``python -m executor.train``) on this node — or
``--nproc-per-node`` on each of ``--nnodes`` nodes — and rank 0 writes the RunReport, which is
printed, written to ``--out`` and, with ``--server``, stored by the service beside the plan.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.table import Table

from planner.console import make_console, styled
from planner.contracts import ClusterProfile, ParallelLayout, Plan, RunReport
from planner.contracts.report import term_comparison
from planner.errors import AutoparError
from planner.files import check_out, check_out_dir, kept_name, read_input

err = make_console(stderr=True)  # markup off: names and paths are user text
console = make_console()
GiB = 2**30
MAX_LR = 10.0  # AdamW steps each weight by about lr: above this a run only diverges (1e300 overflows)
DEFAULT_WARMUP = 3
# host memory of a CPU rank beside its share of the model: torch, gloo and the executor. Measured peak RSS
# of a worker of the 4-layer test model: 330-336 MiB at 4 and at 16 ranks (torch 2.13 CPU, fp32)
WORKER_BASE_BYTES = 384 * 2**20
# CPU ranks per core of the host: 16 ranks of the test model trained on 2 cores (0.70 s steps where 4
# ranks took 0.037 s); beyond this the ranks only queue for the cores
MAX_RANKS_PER_CORE = 8
SPREAD = "spread the ranks over hosts (--nnodes N --nproc-per-node M on each)"


def check_host(plan: Plan, nproc: int) -> str:
    """Whether this host can run ``nproc`` ranks of ``plan``: on CUDA GPUs (one per rank, each with the
    plan's predicted memory) where the workers would use them (:func:`executor.devices.cuda_ranks`), else
    on the CPU cores and host memory. AutoparError naming what is short and the fix; else one line
    saying what the ranks will use."""
    from executor.devices import cuda_ranks

    return check_gpus(plan, nproc) if cuda_ranks() else check_cpu(plan, nproc)


def check_gpus(plan: Plan, nproc: int) -> str:
    """``nproc`` CUDA GPUs, each holding the plan's predicted memory per GPU."""
    import torch

    have = torch.cuda.device_count()
    if have < nproc:
        raise AutoparError("--nproc-per-node", nproc, f"run on a host with {nproc} GPUs, {SPREAD}, or set "
                           "AUTOPAR_FORCE_CPU=1 to run them as CPU ranks",
                           problem=f"ranks need a CUDA GPU each, and this host has {have}")
    need = plan.prediction.memory.total_bytes
    for i in range(nproc):
        props = torch.cuda.get_device_properties(i)
        if props.total_memory < need:
            raise AutoparError("plan.prediction.memory.total_bytes", need, "plan for this GPU (`autopar profile "
                               "--out prof.json`, then `autopar plan --profile prof.json`)",
                               problem=f"({need / GiB:.1f} GiB per GPU) is more than GPU {i} ({props.name}) holds, "
                                       f"{props.total_memory / GiB:.1f} GiB")
    return f"{nproc} rank(s) on {nproc} of this host's {have} CUDA GPU(s), {need / GiB:.1f} GiB each predicted"


def check_cpu(plan: Plan, nproc: int) -> str:
    """At most :data:`MAX_RANKS_PER_CORE` ranks per core this process may use, and host memory for
    ``nproc x (WORKER_BASE_BYTES + the plan's parameters, gradients, optimizer states and activations
    per rank)`` (its buffers are a GPU's CUDA context and NCCL, which a CPU rank has not)."""
    from profiler.identity import available_memory_bytes

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if nproc > MAX_RANKS_PER_CORE * cores:
        raise AutoparError("--nproc-per-node", nproc, f"run at most {MAX_RANKS_PER_CORE * cores} here: {SPREAD}, "
                           "or plan for fewer ranks", problem=f"CPU ranks are more than {MAX_RANKS_PER_CORE} per core "
                                                              f"of this host's {cores}")
    mem = plan.prediction.memory
    share = mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes + mem.activations_bytes
    need = nproc * (WORKER_BASE_BYTES + share)
    have = available_memory_bytes("cpu")
    if need > have:
        raise AutoparError("--nproc-per-node", nproc, f"{SPREAD}, plan for more ranks that each hold less, or free "
                           "memory",
                           problem=f"CPU ranks need about {need / GiB:.1f} GiB ({WORKER_BASE_BYTES / GiB:.2f} "
                                   f"GiB each for torch, {share / GiB:.2f} GiB for its share of the model), "
                                   f"and this host has {have / GiB:.1f} GiB available")
    return (f"{nproc} CPU rank(s) on this host's {cores} core(s), about {need / GiB:.1f} GiB of its "
            f"{have / GiB:.1f} GiB available")


def _invalid(exc: ValidationError, flag: str, path: Path, prefix: str, what: str, fix: str) -> AutoparError:
    """One line for a document that does not validate: its first problem, named by its field
    (``prefix.loc``), or by ``flag`` and the path where the whole document is wrong (not JSON,
    empty, nested too deeply), and how many problems there are."""
    problems = exc.errors()
    first = problems[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if not loc:
        return AutoparError(flag, str(path), fix, problem=f"is not a valid {what} ({msg})")
    where = f"{len(problems)} problem(s) in {flag} {path}"
    if first["type"] == "missing":
        return AutoparError(f"{prefix}.{loc}", None, fix, problem=f"is missing: not a valid {what} ({where})")
    value = first.get("input")
    return AutoparError(f"{prefix}.{loc}", "..." if isinstance(value, (dict, list)) else value, fix,
                        problem=f"is not a valid {what} ({msg}; {where})")


def check_checkpoint_options(checkpoint_dir: Path | None, checkpoint_every: int, resume: bool,
                             async_checkpoint: bool) -> None:
    """``autopar run``'s checkpoint options agree with each other and with the folder (AutoparError)."""
    if checkpoint_every and checkpoint_dir is None:
        raise AutoparError("--checkpoint-every", checkpoint_every, "also give --checkpoint-dir DIR",
                           problem="has nowhere to save")
    if resume and checkpoint_dir is None:
        raise AutoparError("--resume", True, "give --checkpoint-dir DIR", problem="has no checkpoint to resume from")
    if async_checkpoint and not checkpoint_every:
        need = "--checkpoint-every K" if checkpoint_dir is not None else "--checkpoint-dir DIR --checkpoint-every K"
        raise AutoparError("--async-checkpoint", True, f"also give {need}, or drop --async-checkpoint",
                           problem="has no checkpoints to save")
    if checkpoint_dir is not None and checkpoint_every:  # saved into
        check_out_dir(checkpoint_dir, "--checkpoint-dir")
    elif checkpoint_dir is not None and checkpoint_dir.exists() and not checkpoint_dir.is_dir():
        raise AutoparError("--checkpoint-dir", str(checkpoint_dir), "give the folder the checkpoints are in",
                           problem="is a file")  # a resume that saves nothing only reads: no write check
    if checkpoint_dir is not None and not resume:
        from executor.checkpoint import latest_step

        found = latest_step(checkpoint_dir)
        if found is not None:
            raise AutoparError("--checkpoint-dir", str(checkpoint_dir), "pass --resume to continue from it, or use "
                               "an empty directory", problem=f"already holds a checkpoint of step {found}")


def _optional_worker_args(paths: dict[str, Path | None], checkpoint_every: int, async_checkpoint: bool,
                          resume: bool, plan_id: int | None) -> list[str]:
    """The worker's arguments for the options ``autopar run`` was given: files as absolute paths."""
    args: list[str] = []
    for flag, value in paths.items():
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
    return args


def _start_line(layout: ParallelLayout, nproc: int, nnodes: int, steps: int) -> str:
    return (f"starting {nproc} worker(s) x {nnodes} node(s): pp={layout.pp} dp={layout.dp_replicate}x{layout.dp_shard} "
            f"cp={layout.cp} tp={layout.tp}{' sp' if layout.sp else ''} ep={layout.ep}"
            f"{f' etp={layout.etp}' if layout.etp is not None else ''} zero={layout.zero_stage} "
            f"micro-batch {layout.micro_batch_size}, {steps} steps")


def load_plan(path: Path) -> Plan:
    """The Plan in ``path``; a missing file or an invalid plan is an AutoparError naming the field."""
    data = read_input(path, "PLAN.json", "Plan written by `autopar plan --out`")
    try:
        return Plan.model_validate_json(data)
    except ValidationError as exc:
        raise _invalid(exc, "PLAN.json", path, "plan", "Plan",
                       "write the plan with `autopar plan --out PLAN.json`") from None


def load_profile(path: Path | None) -> ClusterProfile | None:
    """The ClusterProfile of ``--profile`` (the peak the worker measures MFU against), read and checked
    before the workers start: they read it only after training."""
    if path is None:
        return None
    fix = "give a ClusterProfile JSON, e.g. one written by `autopar profile --out`"
    data = read_input(path, "--profile", "ClusterProfile JSON")
    try:  # its validators hold the positive bf16/fp16 peak the MFU needs
        return ClusterProfile.model_validate_json(data)
    except ValidationError as exc:
        raise _invalid(exc, "--profile", path, "profile", "ClusterProfile", fix) from None


def load_hf_config(path: Path | None, plan: Plan) -> dict | None:
    """The HF config.json, checked against the plan's model (same shape, or the run is not the plan)."""
    if path is None:
        return None
    fix = "give a readable Hugging Face config.json"
    data = read_input(path, "--hf-config", "Hugging Face config.json")
    try:
        config = json.loads(data)
    except RecursionError:
        raise AutoparError("--hf-config", str(path), fix,
                           problem="cannot be read as JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError (not UTF-8 text)
        raise AutoparError("--hf-config", str(path), fix, problem=f"cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AutoparError("--hf-config", str(path), "a config.json holds one JSON object of model settings",
                           problem=f"holds a JSON {type(config).__name__}, not an object")
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
                  f"{pred.memory.as_measured(report.memory_kind) / GiB:.2f} GiB")
    console.print(table)
    render_terms(report, plan)
    render_checkpoints(report, plan)
    if report.steps:
        first, last = report.steps[0], report.steps[-1]
        timed = [s for s in report.steps[report.warmup_steps:] if not s.profiled]
        console.print(f"loss {first.loss:.4f} (step {first.step}) -> {last.loss:.4f} (step {last.step}); "
                      f"median over {len(timed)} step(s) after {report.warmup_steps} warm-up"
                      + (f" and before {len(report.steps) - report.warmup_steps - len(timed)} profiled"
                         if report.breakdown else ""))


def render_checkpoints(report: RunReport, plan: Plan) -> None:
    """Each checkpoint mode's saves: measured blocking and write times beside the plan's goodput prediction."""
    from planner.goodput import checkpoint_comparison

    def secs(v: float | None) -> str:
        return "—" if v is None else f"{v:.3f} s"

    for row in checkpoint_comparison(report, plan.prediction.goodput):
        console.print(f"checkpoints ({row['mode']}): {row['saves']} save(s) of {row['bytes_per_rank'] / GiB:.2f} GiB "
                      f"per rank; blocking {secs(row['blocking_s'])} (first {secs(row['first_blocking_s'])}, "
                      f"predicted {secs(row['predicted_blocking_s'])}), written in {secs(row['write_s'])} "
                      f"(predicted {secs(row['predicted_write_s'])})", highlight=False)


def render_terms(report: RunReport, plan: Plan) -> None:
    """The step by term (``RunReport.breakdown``, the mean over ranks) beside the prediction's, as shares."""
    if not report.breakdown:
        return
    table = Table(title="where the step goes (shares of the step; measured: mean over ranks, profiled steps)")
    for col in ("term", "predicted", "measured"):
        table.add_column(col, justify="left" if col == "term" else "right")
    for row in term_comparison(plan.prediction.terms, report):
        table.add_row(row["term"], *(f"{row[k]:.1%}" if row[k] is not None else "—"
                                     for k in ("predicted_share", "measured_share")))
    console.print(table)


def upload(report: RunReport, server: str, token: str | None, plan_id: int, keep: Path) -> dict:
    """POST the report to ``{server}/v1/runs`` for the stored plan ``plan_id``; if that fails, the
    request body is kept in ``keep`` and the error says how to send it."""
    from planner.client import post_or_keep

    body = {"plan_id": plan_id, "report": json.loads(report.model_dump_json())}
    body["report"]["plan_id"] = str(plan_id)
    return post_or_keep(server, "/v1/runs", json.dumps(body).encode(), token, "run", keep)


def _fallback_file(plan: Plan, lost: int) -> tuple[Plan, Path]:
    """The plan's fallback for ``lost`` nodes (planner.fallback) and a file the workers read it from."""
    from planner.fallback import fallback_plan

    chosen = fallback_plan(plan, lost)
    path = Path(tempfile.mkdtemp(prefix="autopar-fallback-")) / "plan.json"
    path.write_text(chosen.model_dump_json(indent=2))
    return chosen, path


def run(
    plan_file: Annotated[Path, typer.Argument(metavar="PLAN.json", help="a Plan written by `autopar plan --out`")],
    steps: Annotated[int, typer.Option(min=1, help="optimizer steps to run (counted from step 0)")] = 20,
    warmup: Annotated[int | None, typer.Option(min=0, help="first steps left out of the median step time, below "
                                                     "--steps (default 3, or --steps - 1 if that is fewer)")] = None,
    seed: Annotated[int, typer.Option(help="weights and synthetic data seed")] = 0,
    profile_steps: Annotated[int, typer.Option(min=0, max=100, help="the last steps to run under torch.profiler for "
                                               "the step's breakdown by term (left out of the median; 0: none)")] = 2,
    lr: Annotated[float, typer.Option(help="AdamW learning rate (0 to 10)")] = 1e-3,
    checkpoint_dir: Annotated[Path | None, typer.Option(help="save DCP checkpoints here (step_<N>/)")] = None,
    checkpoint_every: Annotated[int, typer.Option(min=0, help="save every K steps (0: never)")] = 0,
    async_checkpoint: Annotated[bool, typer.Option(help="save with dcp.async_save (overlaps the next steps)")] = False,
    resume: Annotated[bool, typer.Option(help="continue from the newest checkpoint in --checkpoint-dir "
                                              "(any plan)")] = False,
    data: Annotated[Path | None, typer.Option(help="flat uint16/uint32 token file (default: synthetic tokens)")] = None,
    hf_config: Annotated[Path | None, typer.Option(help="train a Hugging Face model of this config.json "
                                                             "(random weights) instead of the built-in one")] = None,
    profile: Annotated[Path | None, typer.Option(help="ClusterProfile JSON: the peak the MFU is measured "
                                                      "against")] = None,
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
    dry_run: Annotated[bool, typer.Option("--dry-run", help="check the plan, the options and this host (GPUs, or CPU "
                                                            "cores and memory) and exit: 0 if it can run "
                                                            "here")] = False,
    record_dir: Annotated[Path | None, typer.Option(hidden=True, help="tests: every rank's losses, first-step "
                                                    "gradients and final weights")] = None,
    fallback: Annotated[int | None, typer.Option(min=1, help="run the plan's fallback for this many lost nodes "
                                                 "(autopar plan --fallbacks); with --resume it continues from the "
                                                 "last checkpoint on the nodes left")] = None,
) -> None:
    """Train with a plan under torchrun and report measured step time, tokens/s, MFU and memory.

      autopar run plan.json --steps 50 --out report.json

      autopar run plan.json --checkpoint-dir ckpt --checkpoint-every 10 --max-restarts 2

      autopar run plan.json --nnodes 2 --node-rank 0 --master-addr node0 --nproc-per-node 8

      autopar run plan.json --dry-run

      autopar run plan.json --fallback 1 --checkpoint-dir ckpt --resume
    """
    try:
        plan = load_plan(plan_file)
        if fallback is not None:
            plan, plan_file = _fallback_file(plan, fallback)
        config = load_hf_config(hf_config, plan)
        warmup, nproc = _check_run_options(plan, lr, steps, warmup, nproc_per_node, nnodes, node_rank,
                                           server, plan_id)
        check_checkpoint_options(checkpoint_dir, checkpoint_every, resume, async_checkpoint)
        load_profile(profile)
        if data is not None:  # the checks each worker makes, made here: a bad file is no torchrun traceback
            from executor.data import check_token_file

            check_token_file(data, plan.training.seq_length, plan.model.vocab_size)
        if out is not None and node_rank == 0:  # node 0's rank 0 writes the report: refused before training
            check_out(out, "report.json")
        host = check_host(plan, nproc)  # 16 CPU workers of a GPU plan used to run until the OOM killer ended them
        from executor.train import check_plan  # imports torch (~1 s): after the checks that need none

        check_plan(plan, hf_config=config)
        if server and node_rank == 0:  # node 0 uploads: asked before the workers start, not after training
            from planner.client import check_plan_stored, check_writable

            check_writable(server, token)
            check_plan_stored(server, plan_id, layout=plan.layout.model_dump(mode="json"))
    except AutoparError as exc:
        err.print(styled(("error:", "bold red"), " ", str(exc)), highlight=False)
        raise typer.Exit(2) from None
    if dry_run:
        console.print(f"ok: {host}; nothing started (--dry-run)", highlight=False)
        return

    report_path = out or Path(tempfile.mkdtemp(prefix="autopar-run-")) / "report.json"
    report_path.unlink(missing_ok=True)
    args = ["--steps", str(steps), "--warmup", str(warmup), "--seed", str(seed), "--lr", str(lr),
            "--profile-steps", str(profile_steps), "--out", str(report_path.resolve())]
    args += _optional_worker_args({"--checkpoint-dir": checkpoint_dir, "--data": data, "--hf-config": hf_config,
                                   "--profile": profile, "--record-dir": record_dir},
                                  checkpoint_every, async_checkpoint, resume, plan_id)
    cmd = worker_command(plan_file.resolve(), nproc_per_node=nproc, nnodes=nnodes, node_rank=node_rank,
                         master_addr=master_addr, master_port=master_port, max_restarts=max_restarts,
                         worker_args=args)
    err.print(_start_line(plan.layout, nproc, nnodes, steps))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                   os.environ.get("PYTHONPATH")]))}
    code = subprocess.call(cmd, env=env)
    if code != 0:
        err.print(styled(("error:", "bold red"), f" the workers failed (torchrun exit status {code}); see their output "
                         "above"))
        raise typer.Exit(1)
    if not report_path.is_file():
        if nnodes == 1:  # rank 0 ran here and wrote none: its error above names where the report was kept
            err.print(styled(("error:", "bold red"), f" no run report at {report_path}; see the workers' output above"))
            raise typer.Exit(1)
        err.print(f"node {node_rank} done (rank 0 writes the report on node 0)")
        return
    _show_and_upload(RunReport.model_validate_json(report_path.read_text()), plan, report_path, out, server, token,
                     plan_id)


def _check_run_options(plan: Plan, lr: float, steps: int, warmup: int | None, nproc_per_node: int | None,
                       nnodes: int, node_rank: int, server: str | None, plan_id: int | None) -> tuple[int, int]:
    """(warmup steps, workers per node) of ``autopar run``'s options, or the AutoparError naming the option."""
    if not math.isfinite(lr) or not 0 <= lr <= MAX_LR:
        raise AutoparError("--lr", lr, f"give a finite learning rate in [0, {MAX_LR:g}], e.g. 1e-3",
                           problem="is not a learning rate AdamW can train with")
    if warmup is None:
        warmup = min(DEFAULT_WARMUP, steps - 1)
    elif warmup >= steps:
        raise AutoparError("--warmup", warmup, f"use --warmup {steps - 1} or less, or more --steps (at least "
                           f"{warmup + 1})", problem=f"is not below --steps {steps}: no step would be timed")
    nproc = nproc_per_node or plan.num_gpus // nnodes
    if nproc * nnodes != plan.num_gpus:
        raise AutoparError("--nproc-per-node", nproc,
                           f"use nnodes x nproc-per-node = plan.num_gpus = {plan.num_gpus}",
                           problem=f"x --nnodes {nnodes} = {nproc * nnodes} workers")
    if node_rank >= nnodes:
        raise AutoparError("--node-rank", node_rank, f"use 0..{nnodes - 1}",
                           problem=f"is not below --nnodes {nnodes}")
    if server and plan_id is None:
        raise AutoparError("--plan-id", None, "give the service's id of this plan (GET /v1/plans)",
                           problem="is missing; the service stores a run beside its plan")
    return warmup, nproc


def _show_and_upload(report: RunReport, plan: Plan, report_path: Path, out: Path | None, server: str | None,
                     token: str | None, plan_id: int | None) -> None:
    """Print the run report beside the plan's prediction; post it to ``server`` (exit 2 if refused)."""
    render_report(report, plan)
    if out is not None:
        err.print(f"report written to {out}")
    if server:
        try:
            stored = upload(report, server, token, plan_id,
                            report_path.parent / kept_name(f"run-of-plan-{plan_id}"))
        except AutoparError as exc:
            err.print(styled(("error:", "bold red"), " ", str(exc)), highlight=False)
            raise typer.Exit(2) from None
        err.print(f"stored as run #{stored.get('id')} of plan #{plan_id} at {server}")
