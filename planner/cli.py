"""The ``autopar`` command line: planner subcommands here, others plugged in by entry point.

Packages that depend on the planner (api, profiler, executor) register their own subcommands in
the ``autopar.commands`` entry-point group, so this module never imports them.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, NamedTuple, get_type_hints

import typer
from pydantic import ValidationError
from rich.table import Table

from planner.console import make_console, styled
from planner.contracts import (
    ClusterProfile,
    ModelSpec,
    Optimizer,
    ParallelLayout,
    Plan,
    Precision,
    Prediction,
    Recompute,
    RunReport,
    Schedule,
    TrainingConfig,
    TrainingGoal,
    json_schemas,
)
from planner.contracts.goodput import MAX_FAILURE_RATE, MAX_GBPS_PER_NODE, MAX_PRICE, MAX_RESTART_S, MAX_TOKENS
from planner.contracts.limits import (
    MAX_FALLBACKS,
    MAX_GLOBAL_BATCH,
    MAX_GLOBAL_BATCH_TOKENS,
    MAX_GPUS,
    MAX_LAYERS,
    MAX_MICRO_BATCH,
    MAX_SEQ,
    MAX_TIME_BUDGET_S,
    MAX_TOP_K,
    MAX_VIRTUAL_STAGES,
)
from planner.errors import AutoparError, validation_problems
from planner.files import check_out, check_out_dir, read_input, write_files, write_or_keep
from planner.search import sizing
from planner.search.options import SearchOptions

SEARCH = SearchOptions()  # the search's defaults (one home: planner/search/options.py)
GOAL = TrainingGoal(steps=1)  # the time-to-train defaults (one home: planner/contracts/goodput.py)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Auto-parallelism planner for training large transformers.")
# piped output (CI logs, benchmark captures) gets wide tables instead of truncated run ids
console = make_console()
err_console = make_console(stderr=True)
GiB = 2**30


def fail(message: str) -> None:
    err_console.print(styled(("error:", "bold red"), " ", message))
    raise typer.Exit(2)


def describe_validation_error(exc: ValidationError, what: str) -> str:
    """One line per problem: the field path, the value and pydantic's explanation."""
    return "\n  ".join(validation_problems(exc, what))


# ---------------------------------------------------------------- inputs
# options shared by `predict` and `plan`
OptModel = Annotated[str | None, typer.Option(help="model preset, e.g. llama3.1-70b (see `autopar presets`)")]
OptModelFile = Annotated[Path | None, typer.Option(help="ModelSpec JSON file")]
OptHfConfig = Annotated[Path | None, typer.Option(
    help="Hugging Face config.json (Llama/Mistral/Qwen/Mixtral/DeepSeek-V3)")]
OptCluster = Annotated[str | None, typer.Option(
    help="reference cluster, or a measured profile shipped with the planner (see `autopar clusters`)")]
OptNodes = Annotated[int | None, typer.Option(
    min=1, max=MAX_GPUS, help="number of nodes (reference clusters; default 1)")]
OptGpus = Annotated[int | None, typer.Option(min=1, max=MAX_GPUS, help="number of GPUs instead of --nodes: part of one "
                                             "node (e.g. 4 of a DGX's 8) or whole nodes (reference clusters)")]
OptProfile = Annotated[Path | None, typer.Option(help="ClusterProfile JSON (measured or reference)")]
OptGlobalBatch = Annotated[str | None, typer.Option(help="sequences per optimizer step: a count (2048), or for "
                                                    "autopar plan a range the search chooses from (1920..2560)")]
OptGlobalBatchTokens = Annotated[int | None, typer.Option(
    min=1, max=MAX_GLOBAL_BATCH_TOKENS, help="tokens per optimizer step")]
OptSeq = Annotated[int, typer.Option(min=1, max=MAX_SEQ, help="sequence length")]
OptPrecision = Annotated[Precision, typer.Option()]
OptOptimizer = Annotated[Optimizer, typer.Option()]
OptUnfusedAttention = Annotated[bool, typer.Option(help="Megatron-2021-style attention that stores the scores")]
OptMoeImbalance = Annotated[float, typer.Option(
    min=1.0, max=64.0, help="MoE: routed tokens on the busiest expert rank / perfect balance")]


def load_model(model: str | None, model_file: Path | None, hf_config: Path | None) -> ModelSpec:
    from planner.hf_config import model_spec_from_hf_config
    from planner.presets import get_preset

    given = [x for x in (model, model_file, hf_config) if x]
    if len(given) != 1:
        fail("give exactly one of --model PRESET, --model-file SPEC.json or --hf-config config.json")
    if model:
        return get_preset(model)
    if hf_config:
        return model_spec_from_hf_config(hf_config)
    assert model_file is not None
    return ModelSpec.model_validate_json(_read(model_file, "--model-file"))


def load_profile(
    cluster: str | None, nodes: int | None, profile: Path | None, gpus: int | None = None
) -> ClusterProfile:
    """A reference cluster or a shipped measured profile by name (``planner/data/measured``), or a
    profile file (a measured one describes its own nodes); ``gpus``: a reference cluster's GPU count."""
    if gpus is not None:
        if nodes is not None or profile is not None:
            raise AutoparError("--gpus", gpus, "give --gpus or --nodes, and --gpus only with a reference --cluster",
                               problem="conflicts with " + ("--nodes" if nodes is not None else "--profile"))
        from planner.errors import UnknownNameError
        from planner.reference import reference_profile

        try:
            return reference_profile(cluster or "dgx-h100", gpus=gpus)
        except UnknownNameError:
            raise AutoparError("--gpus", gpus, "use --gpus with a reference cluster (autopar clusters); a measured "
                               "profile has its own GPUs", problem=f"cannot resize cluster '{cluster}'") from None
    from planner.errors import UnknownNameError
    from planner.reference import SYSTEMS, measured_profiles, reference_profile

    if cluster is not None and not cluster.strip():  # given empty is not left out (dgx-h100)
        raise AutoparError("--cluster", cluster, "give a cluster name (`autopar clusters` lists them), or leave "
                           "--cluster out for dgx-h100", problem="is empty")
    if profile is None:
        try:
            return reference_profile(cluster or "dgx-h100", nodes or 1)
        except UnknownNameError:  # only then read the shipped measured profiles
            shipped = {p.name: p for p in measured_profiles()}
            if cluster not in shipped:
                raise UnknownNameError("cluster", cluster, [*SYSTEMS, *shipped]) from None
        loaded = shipped[cluster]
    elif cluster:
        raise AutoparError("--cluster", cluster, "give either --cluster or --profile",
                           problem="conflicts with --profile")
    else:
        loaded = ClusterProfile.model_validate_json(_read(profile, "--profile"))
    if nodes is None or nodes == loaded.num_nodes:
        return loaded
    if loaded.kind == "measured":
        raise AutoparError("--nodes", nodes, f"drop --nodes (this measured profile has {loaded.num_nodes} nodes) "
                           "or measure the cluster you plan for", problem="cannot change a measured profile")
    return loaded.with_nodes(nodes)


def parse_global_batch(text: str | None) -> tuple[int | None, int | None]:
    """``--global-batch``: ``"2048"`` -> (2048, None); ``"1920..2560"`` -> (1920, 2560), the range's ends."""
    if text is None:
        return None, None
    low, dots, high = text.strip().partition("..")
    fix = f"give a count of sequences from 1 to {MAX_GLOBAL_BATCH:,} (2048) or a range low..high (1920..2560)"
    try:
        ends = (int(low), int(high) if dots else None)
    except ValueError:
        raise AutoparError("--global-batch", text, fix, problem="is not a count or a range") from None
    if not all(e is None or 1 <= e <= MAX_GLOBAL_BATCH for e in ends):
        raise AutoparError("--global-batch", text, fix, problem="is outside 1..2^24")
    if dots and ends[1] < ends[0]:
        raise AutoparError("--global-batch", text, fix, problem="is a range whose high end is below its low end")
    return ends


def load_training(seq: int, global_batch: int | None, global_batch_tokens: int | None, precision: Precision,
                  optimizer: Optimizer, unfused_attention: bool, moe_imbalance: float) -> TrainingConfig:
    if global_batch is None and global_batch_tokens is None:
        fail("give --global-batch (sequences) or --global-batch-tokens")
    return TrainingConfig(seq_length=seq, global_batch_size=global_batch, global_batch_tokens=global_batch_tokens,
                          precision=precision, optimizer=optimizer, flash_attention=not unfused_attention,
                          moe_load_imbalance=moe_imbalance)


class JobInputs(NamedTuple):
    """The job a command plans or predicts: what :func:`with_job` loaded from its options."""

    model: ModelSpec
    profile: ClusterProfile
    training: TrainingConfig
    global_batch_max: int | None = None  # --global-batch low..high: the high end (autopar plan only)

    def one_batch(self, command: str) -> tuple[ModelSpec, ClusterProfile, TrainingConfig]:
        """(model, profile, training) of a command that takes one global batch, not a range."""
        if self.global_batch_max is not None:
            raise AutoparError("--global-batch", f"{self.training.global_batch_size}..{self.global_batch_max}",
                               f"give one count to {command}; a range is for autopar plan", problem="is a range")
        return self.model, self.profile, self.training


# the options that describe a job, shared by `plan` and `predict` (one home: name, type and help, default)
JOB_OPTIONS: tuple[tuple[str, object, object], ...] = (
    ("model", OptModel, None), ("model_file", OptModelFile, None), ("hf_config", OptHfConfig, None),
    ("cluster", OptCluster, None), ("nodes", OptNodes, None), ("gpus", OptGpus, None), ("profile", OptProfile, None),
    ("global_batch", OptGlobalBatch, None), ("global_batch_tokens", OptGlobalBatchTokens, None),
    ("seq", OptSeq, 4096), ("precision", OptPrecision, Precision.bf16), ("optimizer", OptOptimizer, Optimizer.adamw),
    ("unfused_attention", OptUnfusedAttention, False), ("moe_imbalance", OptMoeImbalance, 1.0),
)


def with_job(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command`` the :data:`JOB_OPTIONS` before its own options and call it with ``job``, the
    :class:`JobInputs` they load (model, then cluster, then training: the first bad one is the error)."""
    own_hints = get_type_hints(command, include_extras=True)
    own = [p.replace(annotation=own_hints[p.name]) for p in inspect.signature(command).parameters.values()
           if p.name != "job"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=hint, default=default)
             for name, hint, default in JOB_OPTIONS]

    @functools.wraps(command)
    def run(**options: object) -> None:
        o = {name: options.pop(name) for name, _, _ in JOB_OPTIONS}
        model = load_model(o["model"], o["model_file"], o["hf_config"])
        profile = load_profile(o["cluster"], o["nodes"], o["profile"], o["gpus"])
        low, high = parse_global_batch(o["global_batch"])
        job = JobInputs(model, profile, load_training(o["seq"], low, o["global_batch_tokens"], o["precision"],
                                                      o["optimizer"], o["unfused_attention"], o["moe_imbalance"]),
                        high)
        command(job=job, **options)

    params = [*added, *(p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own)]
    run.__signature__ = inspect.Signature(params)  # what typer reads
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


def _read(path: Path, flag: str) -> str:
    return read_input(path, flag)


def _layout(
    num_gpus: int, tp: int, pp: int, cp: int, ep: int, dp: int | None, dp_replicate: int | None, sp: bool, zero: int,
    reshard: bool, micro_batch: int, schedule: Schedule, vp: int | None, layers_per_stage: str | None,
    recompute: Recompute, offload: bool, tp_overlap: bool, dp_overlap: bool, etp: int | None = None,
    offload_fraction: float = 1.0,
) -> ParallelLayout:
    if dp is None:
        if num_gpus % (tp * pp * cp):
            raise AutoparError("tp x pp x cp", tp * pp * cp, f"use degrees whose product divides the {num_gpus} GPUs",
                               problem=f"does not divide the {num_gpus} GPUs")
        dp = num_gpus // (tp * pp * cp)
    # options the layout would carry and nothing would use: refused, not silently ignored
    if pp == 1 and schedule not in (Schedule.one_f_one_b, Schedule.interleaved_1f1b):  # interleaved: the contract's
        raise AutoparError("--schedule", schedule.value, "use --pp 2 or more to pipeline, or leave --schedule out",
                           problem="has no pipeline to schedule with pp=1")
    if not reshard and zero != 3:
        raise AutoparError("--no-reshard", True, "use --zero 3 (it keeps ZeRO-3's gathered weights after the forward), "
                           "or leave --no-reshard out", problem=f"has no gathered weights to keep with ZeRO-{zero}")
    if tp_overlap and tp == 1:
        raise AutoparError("--tp-overlap", True, "use --tp 2 or more, or leave --tp-overlap out",
                           problem="has no tensor-parallel collectives to overlap with tp=1")
    replicate = dp_replicate if dp_replicate is not None else (dp if zero == 0 else 1)
    if dp % replicate:
        raise AutoparError("--dp-replicate", replicate, f"use a divisor of dp={dp}", problem=f"does not divide dp={dp}")
    counts = None
    if layers_per_stage:
        try:
            counts = [int(x) for x in layers_per_stage.split(",")]
        except ValueError:
            raise AutoparError("--layers-per-stage", layers_per_stage, "give comma-separated integers, e.g. 9,10,10,9",
                               problem="is not a list of integers") from None
    depth = {} if vp is None else {"virtual_stages": vp}  # unstated: the schedule's own (the contract's default)
    return ParallelLayout(
        dp_replicate=replicate, dp_shard=dp // replicate, tp=tp, sp=sp, cp=cp, pp=pp, ep=ep, etp=etp, zero_stage=zero,
        reshard_after_forward=reshard, micro_batch_size=micro_batch, schedule=schedule, **depth,
        layers_per_stage=counts, recompute=recompute, offload_optimizer=offload,
        optimizer_offload_fraction=offload_fraction, tp_comm_overlap=tp_overlap,
        dp_comm_overlap=dp_overlap,
    )


# ---------------------------------------------------------------- rendering
def render_search(plan: Plan, top_families: int = 12) -> None:
    """Alternatives, why the other families lost, and what the search did."""
    best = plan.prediction
    if plan.alternatives:
        at = Table(title=f"Top {len(plan.alternatives) + 1} plans")
        for col in ("#", "layout", "step", "MFU", "memory", "vs best", "why slower"):
            at.add_column(col, justify="right" if col in ("#", "step", "MFU", "memory", "vs best") else "left")
        at.add_row("1", plan.layout.summary(), f"{best.step_time_s:.3f} s", f"{best.mfu:.1%}",
                   f"{best.memory.total_bytes / GiB:.1f} GiB", "", "chosen")
        for i, alt in enumerate(plan.alternatives, 2):
            p = alt.prediction
            at.add_row(str(i), alt.layout.summary(), f"{p.step_time_s:.3f} s" if p else "-",
                       f"{p.mfu:.1%}" if p else "-", f"{p.memory.total_bytes / GiB:.1f} GiB" if p else "-",
                       f"{alt.slower_by:+.2%}" if alt.slower_by is not None else "", alt.reason)
        console.print(at)
    rep = plan.search
    if rep is None:
        return
    ft = Table(title=f"Why the other structures lost (best of each; {len(rep.families)} structures)")
    for col in ("structure", "candidates", "best step", "vs chosen", "reason"):
        ft.add_column(col, justify="right" if col in ("candidates", "best step", "vs chosen") else "left")
    for fam in rep.families[:top_families]:
        ft.add_row(fam.family, str(fam.members), f"{fam.best_step_s:.3f} s" if fam.best_step_s else "-",
                   f"{fam.slower_by:+.1%}" if fam.slower_by is not None else "-", fam.reason)
    if len(rep.families) > top_families:
        ft.add_row(f"... {len(rep.families) - top_families} more", "", "", "", "see --json")
    console.print(ft)
    removed = sum(rep.removed_by_rule.values())
    console.print(f"search: {rep.candidates_considered:,} candidates; {removed:,} removed by rules, "
                  f"{rep.dominated:,} dominated, {rep.memory_infeasible:,} do not fit, "
                  f"{rep.pruned_by_bound:,} pruned by bound, {rep.evaluated:,} priced, "
                  f"{rep.solved:,} solved by CP-SAT {dict(rep.solver_status_counts)}, "
                  f"{rep.closed_without_solver:,} closed without it; {rep.wall_s:.2f} s. "
                  f"Chosen plan: {plan.solver_status}")
    for rule, count in sorted(rep.removed_by_rule.items(), key=lambda x: -x[1]):
        console.print(f"  removed {count:,}: {rule} (e.g. {rep.rule_examples.get(rule, '')})")


def render_prediction(plan: Plan) -> None:
    p, lay = plan.prediction, plan.layout
    console.print(styled((plan.model.name, "bold"), " on ", (plan.cluster, "bold"), f" ({plan.num_gpus} GPUs), "
                         f"global batch {plan.training.global_batch_seqs} x {plan.training.seq_length} tokens, "
                         f"{plan.precision.value}"))
    console.print(f"layout: dp={lay.dp} (replicate {lay.dp_replicate} x shard {lay.dp_shard}, ZeRO-{lay.zero_stage}) "
                  f"tp={lay.tp}{' +SP' if lay.sp else ''} cp={lay.cp} pp={lay.pp} ep={lay.ep}"
                  f"{f' etp={lay.etp}' if lay.etp is not None else ''} | micro-batch "
                  f"{lay.micro_batch_size}, {lay.schedule.value}"
                  f"{f' v={lay.virtual_stages}' if lay.virtual_stages > 1 else ''}"
                  f", recompute {lay.recompute_summary()}"
                  f"{f', optimizer offload {lay.offload_share:.0%}' if lay.offload_optimizer else ''}"
                  f"{', torch.compile' if lay.compile else ''}"
                  f"{f', layers per stage {lay.layers_per_stage}' if lay.layers_per_stage else ''}")
    t = Table(title="Prediction", show_header=False)
    t.add_row("step time", f"{p.step_time_s:.3f} s" + (
        f" ({p.interval.level:.0%} of held-out runs like it: {p.interval.low_s:.3f}-{p.interval.high_s:.3f} s, "
        f"regime {p.interval.regime}, {p.interval.rows} runs)" if p.interval else ""))
    t.add_row("throughput", f"{p.tokens_per_s:,.0f} tokens/s ({p.tokens_per_s_per_gpu:,.0f} per GPU)")
    t.add_row("MFU / HFU", f"{p.mfu:.1%} / {p.hfu:.1%}")
    t.add_row("pipeline bubble", f"{p.bubble_time_s:.3f} s ({p.bubble_fraction:.1%})")
    t.add_row("optimizer step", f"{p.optimizer_time_s:.3f} s")
    t.add_row("exposed communication", f"{p.exposed_comm_time_s:.3f} s")
    console.print(t)
    m = p.memory
    mt = Table(title=f"Peak memory per GPU (stage {m.stage}) — {'fits' if m.fits else 'DOES NOT FIT'}")
    for col in ("params", "grads", "optimizer", "activations", "buffers", "total", "capacity"):
        mt.add_column(col, justify="right")
    mt.add_row(*(f"{v / GiB:.1f} GiB" for v in (m.params_bytes, m.grads_bytes, m.optimizer_bytes, m.activations_bytes,
                                               m.buffers_bytes, m.total_bytes, m.capacity_bytes)))
    console.print(mt)
    if m.terms:
        console.print("buffers: " + ", ".join(f"{k.replace('_', ' ')} {v / GiB:.1f} GiB" for k, v in m.terms.items())
                      + f"; {m.headroom_bytes / GiB:.1f} GiB kept free (memory_headroom)")
    if p.comm:
        ct = Table(title="Communication per step (critical stage)")
        for col in ("kind", "level", "group", "time", "exposed", "overlapped"):
            ct.add_column(col, justify="right" if col not in ("kind", "level") else "left")
        for c in p.comm:
            ct.add_row(c.kind, c.level.value, str(c.group_size), f"{c.time_s:.3f} s", f"{c.exposed_s:.3f} s",
                       f"{c.overlapped_s:.3f} s")
        console.print(ct)
    if len(p.stages) > 1:
        st = Table(title="Pipeline stages (one micro-batch)")
        for col in ("stage", "layers", "forward", "backward", "in flight", "memory"):
            st.add_column(col, justify="right")
        for s in p.stages:
            st.add_row(str(s.stage), str(s.layers), f"{s.forward_s * 1e3:.1f} ms", f"{s.backward_s * 1e3:.1f} ms",
                       f"{s.microbatches_in_flight:.2f}", f"{s.memory_bytes / GiB:.1f} GiB")
        console.print(st)
    for note in p.notes:
        console.print(styled(("note:", "yellow"), " ", note))


# ---------------------------------------------------------------- commands
@app.command()
@with_job
def predict(
    job: JobInputs,
    tp: Annotated[int, typer.Option(min=1, max=MAX_GPUS, help="tensor parallel degree")] = 1,
    pp: Annotated[int, typer.Option(min=1, max=MAX_LAYERS, help="pipeline parallel degree")] = 1,
    cp: Annotated[int, typer.Option(min=1, max=MAX_GPUS, help="context parallel degree")] = 1,
    ep: Annotated[int, typer.Option(min=1, max=MAX_GPUS, help="expert parallel degree")] = 1,
    etp: Annotated[int | None, typer.Option(
        min=1, max=MAX_GPUS, help="expert tensor parallel degree: the routed "
        "experts' TP degree, dividing tp (MoE parallel folding; default: tp)")] = None,
    dp: Annotated[int | None, typer.Option(
        min=1, max=MAX_GPUS, help="data parallel degree (default: GPUs / (tp x pp x cp))")] = None,
    dp_replicate: Annotated[int | None, typer.Option(
        min=1, max=MAX_GPUS, help="HSDP replicate groups (default: all of dp for ZeRO-0, else 1)")] = None,
    sp: Annotated[bool, typer.Option(help="sequence parallel with TP")] = False,
    zero: Annotated[int, typer.Option(min=0, max=3, help="ZeRO stage over the dp shard group (0 = DDP)")] = 0,
    reshard: Annotated[bool, typer.Option(help="ZeRO-3: free gathered weights after forward")] = True,
    micro_batch: Annotated[int, typer.Option(min=1, max=MAX_GLOBAL_BATCH, help="micro-batch size (sequences)")] = 1,
    schedule: Annotated[Schedule, typer.Option(help="pipeline schedule")] = Schedule.one_f_one_b,
    vp: Annotated[int | None, typer.Option(min=1, max=MAX_LAYERS, help="chunks per pipeline rank (interleaved; "
                                           "default: the schedule's own, 2 for the V schedules, else 1)")] = None,
    layers_per_stage: Annotated[str | None, typer.Option(help="comma-separated layers per (virtual) stage")] = None,
    recompute: Annotated[Recompute, typer.Option(help="activation recompute")] = Recompute.none,
    offload: Annotated[bool, typer.Option(help="optimizer states and step on the CPU")] = False,
    offload_fraction: Annotated[float, typer.Option(
        min=0.01, max=1.0, help="with --offload: the share of the optimizer on the CPU, the rest "
        "on the GPU (Megatron ZeRO-1, DeepSpeed ZeRO-3)")] = 1.0,
    tp_overlap: Annotated[bool, typer.Option(help="overlap TP collectives with GEMMs")] = False,
    dp_overlap: Annotated[bool, typer.Option(help="overlap gradient reduction / weight gathers")] = True,
    compile_model: Annotated[bool, typer.Option("--compile", help="torch.compile of model and loss (torchtitan; "
                                                "the loss then keeps 4 B per logit)")] = False,
    target: Annotated[str, typer.Option(help="what will run it: autopar (our executor), megatron, deepspeed or "
                                        "torchtitan; prices its loss memory, model states and pipeline sends "
                                        "(planner/targets/)")] = "autopar",
    as_json: Annotated[bool, typer.Option("--json", help="print the Plan (layout + prediction) as JSON")] = False,
) -> None:
    """Predict step time, throughput, MFU, memory and communication of one given layout."""
    from planner.cost.predict import predict as run_prediction
    from planner.targets import planned_scatter_gather

    spec, prof, training = job.one_batch("predict")
    layout = _layout(prof.num_gpus, tp, pp, cp, ep, dp, dp_replicate, sp, zero, reshard, micro_batch, schedule, vp,
                     layers_per_stage, recompute, offload, tp_overlap, dp_overlap, etp, offload_fraction)
    # the pipeline sends what the target's stages send (TargetFacts.pp_sends)
    layout = layout.model_copy(update={"pp_scatter_gather": planned_scatter_gather(target, spec, layout.sp),
                                       "compile": compile_model})
    prediction: Prediction = run_prediction(spec, training, prof, layout, target=target)
    plan = Plan(model=spec, training=training, cluster=prof.name, num_gpus=prof.num_gpus, layout=layout,
                precision=training.precision, target=target, prediction=prediction)
    if as_json:
        print(plan.model_dump_json(indent=2))
    else:
        render_prediction(plan)


@app.command()
@with_job
def plan(
    job: JobInputs,
    top: Annotated[int, typer.Option(
        "--top", min=1, max=MAX_TOP_K, help="alternatives to keep (top K plans)")] = SEARCH.top_k,
    max_micro_batch: Annotated[int, typer.Option(
        min=1, max=MAX_MICRO_BATCH, help="largest micro-batch size to consider")] = SEARCH.max_micro_batch_size,
    max_vp: Annotated[int, typer.Option(
        min=1, max=MAX_VIRTUAL_STAGES, help="most virtual stages per rank to consider")] = SEARCH.max_virtual_stages,
    max_tp: Annotated[int | None, typer.Option(
        min=1, max=MAX_GPUS, help="largest TP degree (default: GPUs per node)")] = None,
    max_pp: Annotated[int | None, typer.Option(
        min=1, max=MAX_GPUS, help="largest pipeline depth (1: no pipeline)")] = None,
    max_cp: Annotated[int | None, typer.Option(
        min=1, max=MAX_GPUS, help="largest context-parallel degree (1: no CP)")] = None,
    max_ep: Annotated[int | None, typer.Option(
        min=1, max=MAX_GPUS, help="largest expert-parallel degree (1: no EP)")] = None,
    zero_stages: Annotated[str, typer.Option(
        help="ZeRO stages to consider, comma-separated")] = ",".join(map(str, SEARCH.zero_stages)),
    schedules: Annotated[str, typer.Option(
        help="pipeline schedules to consider, comma-separated")] = ",".join(s.value for s in SEARCH.schedules),
    no_offload: Annotated[bool, typer.Option(help="never offload the optimizer to the CPU")] = not SEARCH.offload,
    no_hsdp: Annotated[bool, typer.Option(help="shard states over all data-parallel ranks only")] = not SEARCH.hsdp,
    sequence_parallel: Annotated[bool, typer.Option(
        help="consider sequence parallelism beside TP (--no-sequence-parallel: never)")] = SEARCH.sequence_parallel,
    tp_overlap: Annotated[bool, typer.Option(
        help="the framework overlaps TP collectives with GEMMs")] = SEARCH.tp_comm_overlap,
    dp_overlap: Annotated[bool, typer.Option(
        help="the framework overlaps gradient reduction / weight gathers")] = SEARCH.dp_comm_overlap,
    ep_overlap: Annotated[bool, typer.Option(
        help="the framework overlaps the expert all-to-all (DualPipe-style)")] = SEARCH.ep_comm_overlap,
    compile_model: Annotated[bool, typer.Option(
        "--compile", help="torch.compile of model and loss (torchtitan)")] = SEARCH.compile,
    time_budget: Annotated[float, typer.Option(
        min=0.1, max=MAX_TIME_BUDGET_S,
        help="seconds after which the search stops and returns its best")] = SEARCH.time_budget_s,
    target: Annotated[str, typer.Option(
        help="what will run the plan: autopar (our executor), megatron, deepspeed or "
        "torchtitan; the search returns only what it runs (planner/targets/)")] = SEARCH.target,
    robust: Annotated[bool, typer.Option(
        help="rank plans by the slow end of their step-time interval")] = SEARCH.robust,
    memory_headroom: Annotated[float | None, typer.Option(min=0.0, max=0.9, help="share of each GPU's memory kept "
                                                          "free beyond every predicted term (default: the profile's, "
                                                          "5% in reference profiles)")] = None,
    tokens: Annotated[float | None, typer.Option(
        min=1, max=MAX_TOKENS, help="tokens to train: rank the plans by expected time-to-train")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="optimizer steps to train (instead of --tokens)")] = None,
    failure_rate: Annotated[float, typer.Option(
        min=1e-12, max=MAX_FAILURE_RATE, help="job-interrupting failures per GPU-hour (default: Llama 3 405B's "
        "419 in 54 days on 16,384 GPUs)")] = GOAL.failure_rate_per_gpu_hour,
    checkpoint_bandwidth: Annotated[float | None, typer.Option(
        min=1e-6, max=MAX_GBPS_PER_NODE,
        help="storage write GB/s per node (default: the profile's measured checkpoint cost where it has one, "
        "else Llama 3's 2 TB/s over 2,048 nodes)")
    ] = None,
    restart_s: Annotated[float, typer.Option(min=0, max=MAX_RESTART_S, help="seconds from a failure until training "
                                             "resumes")] = GOAL.restart_s,
    price_per_gpu_hour: Annotated[float | None, typer.Option(min=1e-6, max=MAX_PRICE, help="USD per GPU-hour")
                                  ] = None,
    idle_gpus: Annotated[bool, typer.Option(help="search an uneven GPU count beside the largest 2^a x 3^b counts "
                                            "below it, leaving GPUs idle where that trains faster "
                                            "(--no-idle-gpus: all of them)")] = SEARCH.idle_gpus,
    fallbacks: Annotated[int, typer.Option(min=0, max=MAX_FALLBACKS, help="also plan for the loss of 1..K nodes "
                                           "(autopar run --fallback K resumes with one)")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print the Plan as JSON")] = False,
    out: Annotated[Path | None, typer.Option(help="also write the Plan JSON here (for explain / export)")] = None,
) -> None:
    """Search every layout (TP/PP/DP/SP/CP/EP x ZeRO x recompute x micro-batch x schedule) for the fastest that fits;
    with --tokens or --steps, rank the plans by expected time-to-train (failures and checkpoints included)."""
    from rich.progress import Progress

    from planner.search import search

    spec, prof, training, high = job
    if memory_headroom is not None:
        prof = prof.model_copy(update={"assumptions": prof.assumptions.model_copy(
            update={"memory_headroom": memory_headroom})})
    if out is not None:
        check_out(out, "plan.json")  # before the search, which may take its whole --time-budget
    goal = _goal(tokens, steps, failure_rate, checkpoint_bandwidth, restart_s, price_per_gpu_hour)
    from planner.targets import Target

    if target not in {t.value for t in Target}:
        raise AutoparError("--target", target, "use one of " + ", ".join(t.value for t in Target),
                           problem="is not a target autopar plans for")
    opts = SearchOptions(target=target, robust=robust, top_k=top, max_micro_batch_size=max_micro_batch,
                         max_virtual_stages=max_vp, max_tp=max_tp, max_pp=max_pp, max_cp=max_cp, max_ep=max_ep,
                         zero_stages=_int_list(zero_stages, "--zero-stages", {0, 1, 2, 3}),
                         schedules=_schedules(schedules), offload=not no_offload, hsdp=not no_hsdp,
                         sequence_parallel=sequence_parallel,
                         tp_comm_overlap=tp_overlap, dp_comm_overlap=dp_overlap, ep_comm_overlap=ep_overlap,
                         compile=compile_model, time_budget_s=time_budget, idle_gpus=idle_gpus,
                         global_batch_max=high)
    if as_json:
        result = search(spec, training, prof, opts)
    else:
        with Progress(transient=True, console=err_console) as bar:
            task = bar.add_task("searching layouts", total=None)
            result = search(spec, training, prof, opts, progress=lambda i, n: bar.update(task, completed=i, total=n))
    prof = sizing.used_profile(prof, result)  # the GPUs the plan uses (planner.search.sizing)
    if fallbacks:
        from planner.fallback import fallback_plans

        result = result.model_copy(update={"fallbacks": fallback_plans(result, prof, fallbacks, opts)})
    _finish_plan(result, goal, prof, out, as_json)


def _goal(tokens: float | None, steps: int | None, failure_rate: float, gbps: float | None, restart_s: float,
          price: float | None) -> TrainingGoal | None:
    """The time-to-train goal of ``autopar plan``'s flags, or None without --tokens and --steps."""
    if tokens is None and steps is None:
        return None
    if tokens is not None and steps is not None:
        raise AutoparError("--steps", steps, "give --tokens or --steps, not both", problem="is given with --tokens")
    return TrainingGoal(tokens=tokens, steps=steps, failure_rate_per_gpu_hour=failure_rate,
                        checkpoint_gbps_per_node=gbps, restart_s=restart_s, price_per_gpu_hour=price)


def _finish_plan(result: Plan, goal: TrainingGoal | None, prof: ClusterProfile, out: Path | None,
                 as_json: bool) -> None:
    """Rank by time-to-train (with a goal), write ``--out``, print the plan and its goodput line."""
    if goal is not None:
        from planner.goodput import rank_by_time_to_train

        result = rank_by_time_to_train(result, goal, prof).model_copy(update={"goal": goal})
    if out is not None:
        write_or_keep(out, result.model_dump_json(indent=2), "--out", "plan", "autopar-plan")
    if as_json:
        print(result.model_dump_json(indent=2))
        return
    render_prediction(result)
    render_search(result)
    if result.sizing is not None:
        console.print(result.sizing.summary(), markup=False, highlight=False)
    if result.prediction.goodput is not None:
        console.print(result.prediction.goodput.summary(), markup=False, highlight=False)
    for f in result.fallbacks:
        what = (f"{f.layout.summary()}: {f.prediction.step_time_s:.3g} s ({f.slower_by:+.1%})" if f.layout
                else f"none: {f.reason}")
        console.print(f"fallback for {f.lost_nodes} lost node(s), {f.num_gpus} GPUs: {what}", markup=False,
                      highlight=False)
    if out is not None:
        console.print(f"plan written to {out}")


def _int_list(text: str, flag: str, allowed: set[int]) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise AutoparError(flag, text, "give comma-separated integers, e.g. 1,3",
                           problem="is not a list of integers") from None
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise AutoparError(flag, text, f"choose from {sorted(allowed)}", problem="has values outside the allowed set")
    return values


def _schedules(text: str) -> tuple[Schedule, ...]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    known = {s.value: s for s in Schedule}
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise AutoparError("--schedules", text, "choose from " + ", ".join(known), problem="names an unknown schedule")
    return tuple(known[n] for n in names)


def _load_report(path: Path) -> RunReport:
    """A run report written by ``autopar run --out``; an error naming the file where it is not one."""
    try:
        return RunReport.model_validate_json(_read(path, "RUNS"))
    except ValidationError as exc:
        fail(f"{path} is not a valid RunReport:\n  " + describe_validation_error(exc, "report"))
        raise  # unreachable


def _load_plan(path: Path) -> Plan:
    """A saved plan, checked as the planner's own (:func:`planner.cost.checks.check_plan`)."""
    from planner.cost.checks import check_plan

    try:
        plan = Plan.model_validate_json(_read(path, "PLAN.json"))
    except ValidationError as exc:
        fail(f"{path} is not a valid Plan:\n  " + describe_validation_error(exc, "plan"))
        raise  # unreachable
    try:
        check_plan(plan)
    except AutoparError as exc:
        raise AutoparError(f"{path}: {exc.field}", exc.value, exc.fix, problem=exc.problem) from None
    return plan


@app.command()
def explain(
    plan_file: Annotated[Path, typer.Argument(
        metavar="PLAN.json", help="a Plan written by `autopar plan --out` or --json")],
) -> None:
    """Show a saved plan: its prediction, the alternatives and why the rest lost."""
    saved = _load_plan(plan_file)
    render_prediction(saved)
    if saved.search is None and not saved.alternatives:
        console.print("this plan was given by hand (autopar predict): there is no search to explain")
        return
    render_search(saved)


@app.command()
def export(
    plan_file: Annotated[Path, typer.Argument(
        metavar="PLAN.json", help="a Plan written by `autopar plan --out` or --json")],
    to: Annotated[str, typer.Option("--to", help="megatron | deepspeed | torchtitan")],
    out_dir: Annotated[Path | None, typer.Option(
        "--out-dir", help="write the files here instead of printing them")] = None,
) -> None:
    """Write the launch arguments / config of a plan for Megatron-LM, DeepSpeed or torchtitan."""
    from planner.export import export_plan

    if out_dir is not None:
        check_out_dir(out_dir, "--out-dir")
    files = export_plan(_load_plan(plan_file), to)
    if out_dir is None:
        for name, text in files.items():
            print(f"# ===== {name} =====")
            print(text)
        return
    for path in write_files(out_dir, files, "--out-dir"):
        console.print(f"wrote {path}")


@app.command()
def validate(
    file: Annotated[Path | None, typer.Argument(help="CSV with the columns of published_runs.csv (default: the "
                                                "planner's own planner/data/published_runs.csv)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable results")] = False,
    show_defaults: Annotated[bool, typer.Option(help="list the default used for each unstated field")] = True,
) -> None:
    """Predict every judgeable row of a published-runs CSV and compare in the row's own convention."""
    from planner import validate as v

    file = file or v.PUBLISHED_RUNS
    cases, skipped = v.build_cases(v.load_rows(file))
    results = [v.evaluate(c) for c in cases]
    summary = v.summarize([r.error for r in results])
    if as_json:
        print(json.dumps({
            "rows": [{"run_id": r.case.run_id, "source": r.case.source, "metric": r.case.metric,
                      "reported": r.case.reported, "predicted": r.predicted, "error": r.error,
                      "defaults": r.case.defaults} for r in results],
            "skipped": [{"run_id": s.run_id, "source": s.source, "reason": s.reason} for s in skipped],
            # no judged row: the errors are NaN, which is not JSON; null says "none" to every parser
            "summary": {k: None if isinstance(x, float) and x != x else x for k, x in summary.__dict__.items()},
        }, indent=2))
        return
    t = Table(title=f"Predicted vs published ({file.name})")
    for col in ("run", "metric", "reported", "predicted", "error"):
        t.add_column(col, justify="left" if col in ("run", "metric") else "right")
    for r in results:
        t.add_row(r.case.run_id, r.case.metric, f"{r.case.reported:,.4g}", f"{r.predicted:,.4g}", f"{r.error:+.1%}")
    console.print(t)
    by_source: dict[str, list[float]] = {}
    for r in results:
        by_source.setdefault(r.case.source, []).append(r.error)
    st = Table(title="Error by source")
    for col in ("source", "rows", "mean |err|", "median |err|", "max |err|"):
        st.add_column(col, justify="left" if col == "source" else "right")
    for source, errs in by_source.items():
        s = v.summarize(errs)
        st.add_row(source, str(s.rows), f"{s.mean_abs_err:.1%}", f"{s.median_abs_err:.1%}", f"{s.max_abs_err:.1%}")
    console.print(st)
    if show_defaults:
        console.print("Defaults used for fields the source did not state:", style="bold")
        for r in results:
            if r.case.defaults:
                console.print(f"  {r.case.run_id}: " + "; ".join(r.case.defaults), highlight=False)
    if skipped:
        console.print("Rows not judged:", style="bold")
        for s in skipped:
            console.print(f"  {s.run_id}: {s.reason}", highlight=False)
    if not summary.rows:
        console.print("rows=0 median_abs_err=n/a p90_abs_err=n/a max_abs_err=n/a (no row could be judged)")
        return
    console.print(f"rows={summary.rows} median_abs_err={summary.median_abs_err:.1%} "
                  f"p90_abs_err={summary.p90_abs_err:.1%} max_abs_err={summary.max_abs_err:.1%}", highlight=False)


@app.command()
def calibrate(
    profile: Annotated[Path, typer.Argument(help="the cluster's ClusterProfile JSON (its calibration is refitted)")],
    runs: Annotated[list[Path], typer.Argument(help="run folders, each with the plan.json that ran and the "
                                                    "report.json `autopar run --out` wrote for it")],
    out: Annotated[Path, typer.Option(help="where to write the calibrated profile")] = Path("calibrated.json"),
) -> None:
    """Fit the cost model's terms to this cluster's own runs (their breakdown by term) into a new profile.

      autopar calibrate cpu.json runs/dp4 runs/tp2dp2 runs/pp2dp2 --out cpu-calibrated.json
    """
    from planner.run_calibration import CalibrationRun
    from planner.run_calibration import calibrate as fit

    base = ClusterProfile.model_validate_json(_read(profile, "PROFILE"))
    check_out(out, "calibrated.json")
    loaded = [CalibrationRun(str(d), _load_plan(d / "plan.json"), _load_report(d / "report.json")) for d in runs]
    done = fit(base, loaded)
    cal = done.calibration
    table = Table(title=f"calibrated on {len(loaded)} run(s): measured / predicted per term")
    for col in ("term", "factor", "runs' range", "runs"):
        table.add_column(col, justify="left" if col == "term" else "right")
    for term, f in cal.factors.items():
        table.add_row(term, f"x{f.factor:.3g}", f"{f.low:.3g} .. {f.high:.3g}", str(f.runs))
    console.print(table)
    held = "n/a (one run)" if cal.held_out_median_error is None else f"{cal.held_out_median_error:.1%}"
    console.print(f"step time median |error| over these runs: {cal.uncalibrated_median_error:.1%} before, "
                  f"{cal.fitted_median_error:.1%} after (fitted on them); leave-one-run-out {held}: what to "
                  "expect of a plan not yet run", highlight=False)
    saves = [] if done.checkpoint is None else [p for p in done.checkpoint.points if p.run]
    if saves:
        line = done.checkpoint.sync
        console.print(f"checkpoint lines refitted with {len(saves)} save(s) of the runs: sync {line.fixed_s:.3g} s + "
                      f"{line.per_tensor_s * 1e3:.3g} ms/tensor + bytes at {line.bytes_per_s / 1e9:.3g} GB/s",
                      highlight=False)
    write_or_keep(out, done.model_dump_json(indent=2), "--out", "calibrated profile", "autopar-profile")
    console.print(f"calibrated profile written to {out} (plan with --profile {out})")


@app.command()
def schema(
    out: Annotated[Path | None, typer.Option(help="directory to write one <Contract>.schema.json per contract")] = None,
) -> None:
    """JSON Schema of every contract (ModelSpec, TrainingConfig, ClusterProfile, Plan, Prediction, RunReport)."""
    if out is not None:
        check_out_dir(out, "--out")
    schemas = json_schemas()
    if out is None:
        print(json.dumps(schemas, indent=2))
        return
    write_files(out, {f"{name}.schema.json": json.dumps(sch, indent=2) for name, sch in schemas.items()}, "--out")
    console.print(f"wrote {len(schemas)} schemas to {out}")


@app.command()
def presets() -> None:
    """Model presets with their size."""
    from planner.cost.params import active_params, total_params
    from planner.presets import PRESETS

    t = Table(title="Model presets")
    for col in ("name", "layers", "hidden", "heads/kv", "ffn", "vocab", "params", "active"):
        t.add_column(col, justify="left" if col == "name" else "right")
    for name, m in PRESETS.items():
        t.add_row(name, str(m.num_layers), str(m.hidden_size), f"{m.num_attention_heads}/{m.kv_heads}",
                  f"{m.ffn_hidden_size}{' MoE' if m.moe else ''}", str(m.vocab_size),
                  f"{total_params(m) / 1e9:.1f}B", f"{active_params(m) / 1e9:.1f}B")
    console.print(t)


@app.command()
def clusters() -> None:
    """Reference cluster designs (datasheets + published collective bandwidths), and the measured
    profiles shipped with the planner."""
    from planner.reference import SYSTEMS, device_spec

    t = Table(title="Reference clusters (any node count)")
    for col in ("name", "node", "GPU memory", "bf16 peak", "HBM", "NVLink busBW", "network / GPU"):
        t.add_column(col)
    for key, d in SYSTEMS.items():
        dev = device_spec(d)
        t.add_row(key, d.title, f"{dev.memory_bytes / GiB:.0f} GiB", f"{dev.peak_tflops[Precision.bf16]:.0f} TFLOP/s",
                  f"{dev.hbm_bandwidth_bytes_per_s / 1e12:.2f} TB/s", f"{d.intra_all_reduce_gb_s:.0f} GB/s",
                  f"{d.nic_gbit_per_gpu:.0f} Gb/s")
    console.print(t)
    from planner.reference import measured_profiles

    shipped = measured_profiles()
    if shipped:
        m = Table(title="Measured profiles shipped with the planner (their own node count; --cluster NAME)")
        for col in ("name", "GPUs", "GPU memory", "bf16 reached", "memory bandwidth reached", "GEMM points"):
            m.add_column(col)
        for p in shipped:
            reached = p.compute.achieved_matmul_tflops.get(Precision.bf16)
            m.add_row(p.name, f"{p.num_nodes} x {p.gpus_per_node} {p.device.name}",
                      f"{p.device.memory_bytes / GiB:.0f} GiB", f"{reached:.0f} TFLOP/s" if reached else "-",
                      f"{(p.compute.achieved_memory_bandwidth_bytes_per_s or 0) / 1e12:.2f} TB/s",
                      str(len(p.compute.gemm)))
        console.print(m)


def _register_plugins() -> None:
    """Subcommands of other autopar packages (serve, profile, run) from the entry-point group."""
    taken = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    for ep in entry_points(group="autopar.commands"):
        if ep.name in taken:  # registered by its own package's ``python -m`` entry (profiler/__main__.py)
            continue
        try:
            command = ep.load()
        except ImportError as exc:  # e.g. executor without torch installed
            err_console.print(styled(("note:", "yellow"), f" `autopar {ep.name}` unavailable: {exc}"))
            continue
        if isinstance(command, typer.Typer):
            app.add_typer(command, name=ep.name)
        else:
            app.command(name=ep.name)(command)


def main() -> None:
    """Console entry point: bad input becomes a one-line error and exit code 2, never a traceback."""
    _register_plugins()
    try:
        code = app(standalone_mode=False)  # typer returns (not raises) the code of typer.Exit here
        sys.exit(code if isinstance(code, int) else 0)
    except AutoparError as exc:
        err_console.print(styled(("error:", "bold red"), " ", str(exc)), highlight=False)
        sys.exit(2)
    except ValidationError as exc:
        err_console.print(
            styled(("error:", "bold red"), f" invalid {exc.title}:\n  {describe_validation_error(exc, exc.title)}"),
            highlight=False,
        )
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as exc:
        # usage errors (unknown option, bad choice) from typer's bundled click: print, exit 2
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
