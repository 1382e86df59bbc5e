"""Pipeline parallelism with ``torch.distributed.pipelining``: the plan's layer split and schedule.

**Split.** The model is cut into ``pp x virtual_stages`` chunks (pipeline stages) of consecutive
layers. ``layout.layers_per_stage`` holds one count per chunk, in pipeline order (the planner's
contract, :mod:`planner.search.stages`: chunk ``c`` holds the next ``layers_per_stage[c]`` layers);
without it the planner's default split is used (:func:`planner.cost.checks.default_layer_split`:
as even as possible, extra layers to the interior chunks first). Chunk ``c`` runs on pipeline rank
``c % pp`` — rank ``r`` holds chunks ``r, r + pp, r + 2 pp, ...``, the interleaved placement torch's
multi-stage schedules expect and the one the planner prices (``StageModel.rank_layers``); under the V
schedules (``zero_bubble_v``, ``dualpipe_v``) rank ``r`` holds chunks ``r`` and ``2 pp - 1 - r``, so rank 0
holds the embedding and the head (torch's ``style="v"``). Both come from
:func:`planner.cost.pipeline.rank_chunks`. Every chunk holds at least one layer (as the planner's search
guarantees).

Each chunk is a copy of the model with the other layers deleted from ``layers`` (a ModuleDict, so a
kept layer keeps its name "7" and checkpoints do not depend on the plan), the embedding only on
chunk 0 and the final norm and LM head only on the last chunk; a chunk without them takes or
returns hidden states ``[B, S, D]``.

**Schedules** (``layout.schedule``): ``gpipe`` -> ``ScheduleGPipe``, ``1f1b`` -> ``Schedule1F1B``,
``interleaved_1f1b`` -> ``ScheduleInterleaved1F1B`` (``virtual_stages`` chunks per rank),
``zero_bubble`` -> ``ScheduleInterleavedZeroBubble`` with one chunk per rank: ZB-H1 (Qi et al. 2024),
each backward split into an input-gradient step on the critical path and a weight-gradient step that
fills the bubble, the schedule :mod:`planner.cost.pipeline` prices; ``zero_bubble_v`` ->
``ScheduleZBVZeroBubble`` and ``dualpipe_v`` -> ``ScheduleDualPipeV``, two chunks per rank in a V (the
class names are the schedule table's). All run on gloo and NCCL. Gradients are not rescaled by the
schedule (``scale_grads=False``): the loss function returns each micro-batch's share of the step loss,
so the accumulated gradient is the step's.

**Loss.** ``loss_fn(logits, targets)`` of a micro-batch returns its token-loss sum divided by the
step's global token count (:func:`executor.reference.lm_loss`), so the micro-batch losses of all
data-parallel pipelines sum to the global mean. The schedule backpropagates ``grad_scale x`` that
(the data-parallel reduction then averages, see :func:`executor.parallelize.grad_scale`).

**MoE load-balancing loss.** It arises inside every chunk, not at the pipeline's end, so each chunk's
output passes through :class:`_AuxLossGrad`: identity in the forward, and in the backward it also
seeds ``d(aux)/d(aux) = aux_weight x grad_scale``, i.e. the gradient of ``aux_weight x aux`` joins the
chunk's backward exactly as if it were added to the loss (the reference adds ``aux / n_micro`` per
micro-batch, so ``aux_weight = 1 / micro-batches of the global batch``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from executor.hf_pipeline import is_hf_stage, split_hf_model
from planner.contracts import ModelSpec, ParallelLayout
from planner.cost.checks import default_layer_split
from planner.cost.pipeline import SCHEDULES, head_rank
from planner.cost.pipeline import rank_chunks as pipeline_rank_chunks
from planner.errors import AutoparError
from planner.targets import Job, Target, check

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------- split
def num_chunks(layout: ParallelLayout) -> int:
    """Pipeline stages of the whole pipeline: ``pp x virtual_stages``."""
    return layout.pp * layout.virtual_stages


def stage_layer_ids(layout: ParallelLayout, num_layers: int) -> list[list[int]]:
    """Layer indices of every chunk (pipeline stage), in pipeline order: chunk ``c`` holds
    ``layers_per_stage[c]`` consecutive layers after those of chunks ``0..c-1`` and runs on rank
    ``c % pp``. ``layers_per_stage`` None: the planner's default split."""
    n = num_chunks(layout)
    if layout.layers_per_stage is None:
        if n > num_layers:
            raise AutoparError("layout.pp x virtual_stages", n, f"use at most num_layers={num_layers} stages",
                               problem="is more pipeline stages than the model has layers")
        counts = default_layer_split(num_layers, n)
    else:
        counts = list(layout.layers_per_stage)
        if len(counts) != n:
            raise AutoparError("layout.layers_per_stage", counts,
                               f"give one count per stage: pp x virtual_stages = {n} counts",
                               problem=f"has {len(counts)} entries")
        if sum(counts) != num_layers:
            raise AutoparError("layout.layers_per_stage", counts,
                               f"make the counts sum to num_layers={num_layers}",
                               problem=f"sums to {sum(counts)}")
        if min(counts) < 1:
            raise AutoparError("layout.layers_per_stage", counts, "give every stage at least one layer",
                               problem=f"leaves stage {counts.index(min(counts))} empty")
    starts = [sum(counts[:c]) for c in range(n)]
    return [list(range(s, s + k)) for s, k in zip(starts, counts)]


def rank_chunks(layout: ParallelLayout, pp_rank: int) -> list[int]:
    """The chunk (stage) indices pipeline rank ``pp_rank`` runs, in pipeline order: r, r + pp, ... or, for
    the V schedules, r and 2 pp - 1 - r (:func:`planner.cost.pipeline.rank_chunks`, the planner's placement)."""
    return pipeline_rank_chunks(layout.schedule, layout.pp, layout.virtual_stages, pp_rank)


def last_rank(layout: ParallelLayout) -> int:
    """The pipeline rank that runs the last chunk (the head and the loss): pp - 1, or 0 for the V schedules."""
    return head_rank(layout.schedule, layout.pp, layout.virtual_stages)


def _check_splittable(model: nn.Module, pp: int) -> None:
    """The built-in decoder (its layers a ModuleDict) or a Hugging Face causal LM (:mod:`executor.hf_pipeline`)."""
    if isinstance(getattr(model, "spec", None), ModelSpec):
        if isinstance(getattr(model, "layers", None), nn.ModuleDict):
            return
    elif hasattr(model, "config") or is_hf_stage(model):
        return
    raise AutoparError("layout.pp", pp, "use the built-in decoder or a Hugging Face causal LM",
                       problem=f"cannot split a {type(model).__name__} into pipeline stages")


def split_model(model: nn.Module, layout: ParallelLayout, pp_rank: int) -> list[nn.Module]:
    """For each chunk of pipeline rank ``pp_rank`` (see :func:`rank_chunks`), a deep copy of ``model``
    (build it on the meta device: copies are then free) holding only the chunk's layers (names kept),
    the embedding only on chunk 0, the final norm and head only on the last chunk. A Hugging Face
    model's chunks run its own forward (:func:`executor.hf_pipeline.split_hf_model`)."""
    _check_splittable(model, layout.pp)
    if not isinstance(getattr(model, "spec", None), ModelSpec):
        ids = stage_layer_ids(layout, model.config.num_hidden_layers)
        return split_hf_model(model, ids, rank_chunks(layout, pp_rank))
    if model.output is None and layout.pp > 1:
        raise AutoparError("model.tied_embeddings", True, "use untied embeddings (tied_embeddings: false) "
                           "or pp=1", problem="would share one weight between the first and the last stage")
    ids = stage_layer_ids(layout, len(model.layers))
    last = num_chunks(layout) - 1
    parts = []
    for c in rank_chunks(layout, pp_rank):
        part = copy.deepcopy(model)
        keep = {str(i) for i in ids[c]}
        for name in [k for k in part.layers if k not in keep]:
            del part.layers[name]
        if c != 0:
            part.tok_embeddings = None
        if c != last:
            part.norm, part.output, part.has_head = None, None, False
        parts.append(part)
    return parts


# ---------------------------------------------------------------- checks before any process starts
def check_pipeline(layout: ParallelLayout, spec: ModelSpec | int, n_microbatches: int | None = None, *,
                   hf: bool = False) -> None:
    """Raise AutoparError for a pipeline this executor cannot run: a split that does not fit the model
    (``spec``: the ModelSpec or its number of layers), then the first row of the ``autopar`` capability
    table (:data:`planner.targets.TARGETS`) that refuses it: among them a Hugging Face model or tied
    embeddings with pp > 1, and per-rank micro-batch counts (``n_microbatches``, one data-parallel
    pipeline's) that torch's schedule refuses: 1F1B needs at least pp, the multi-chunk schedules a
    multiple of ``n // pp`` rounds. Given only the number of layers, only the table's ``split`` rows
    are read (the others need the model)."""
    num_layers = spec.num_layers if isinstance(spec, ModelSpec) else spec
    stage_layer_ids(layout, num_layers)
    if isinstance(spec, ModelSpec):
        check(Target.autopar, Job(spec, None, layout, micro_batches=n_microbatches, hf=hf))
        return
    depth_only = ModelSpec(name=f"{num_layers}-layer decoder", num_layers=num_layers, hidden_size=64,
                           num_attention_heads=1, ffn_hidden_size=64, vocab_size=64)
    job = Job(depth_only, None, layout, micro_batches=n_microbatches, hf=hf)
    check(Target.autopar, job, scopes=("split",))


# ---------------------------------------------------------------- schedule
class _AuxLossGrad(torch.autograd.Function):
    """``forward(h, aux, w) = h``; ``backward(g) = (g, w, -)``: the gradient of ``w x aux`` joins the
    backward of the stage whose output is ``h`` although ``aux`` is not a stage output."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_meta = weight, (aux.shape, aux.dtype, aux.device)
        # a copy, not a view: the V schedules hand a chunk's output to the rank's next chunk and detach it
        # in place after the input-gradient step, which a view refuses
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


@dataclass
class _AuxRecorder:
    """A MoE chunk's load-balancing loss weight and the aux loss of each of its forwards (detached)."""

    aux_weight: float
    values: list[torch.Tensor]


def _add_aux_loss(part: nn.Module, aux_weight: float, grad_scale: float) -> None:
    """Make the chunk's MoE load-balancing loss (weight ``aux_weight``, times ``grad_scale`` in the gradient)
    enter the backward through its output: a forward hook on the chunk itself, not a wrapper module, so the
    schedule still sees the FSDP2 module (it holds FSDP's gradient sync and resharding back until a split
    backward's weight step has run); ``part.autopar_aux`` records each forward's aux loss."""
    part.autopar_aux = _AuxRecorder(aux_weight, [])

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        aux = module.aux_loss().to(out.device)
        module.autopar_aux.values.append(aux.detach())
        return _AuxLossGrad.apply(out, aux, aux_weight * grad_scale)

    part.register_forward_hook(hook)


@dataclass(frozen=True)
class _StepInfo:
    """What :func:`pipeline_step` needs to know of :func:`build_schedule`'s arguments."""

    grad_scale: float
    n_microbatches: int


def _has_moe(part: nn.Module) -> bool:
    return any(getattr(block, "moe", None) is not None for block in part.layers.values())


def _hf_spec(part: nn.Module) -> ModelSpec:
    """The ModelSpec of a Hugging Face chunk's config (its ``num_hidden_layers`` is the whole model's)."""
    from executor.parallelize import _spec_of

    return _spec_of(part)[0]


def build_schedule(chunks: list[nn.Module], layout: ParallelLayout, pp_group: dist.ProcessGroup,
                   pp_rank: int | None = None, *, n_microbatches: int, loss_fn: LossFn, device: torch.device,
                   grad_scale: float = 1.0, aux_weight: float = 0.0):
    """``(schedule, stages)``: a ``PipelineStage`` per chunk of this rank (``split_model``'s order;
    stage index ``pp_rank + i x pp``, ``pp x virtual_stages`` stages) and the ``layout.schedule``'s torch
    schedule over ``n_microbatches`` micro-batches per step (see the module docstring).

    ``loss_fn(logits, targets)``: a micro-batch's token-loss sum / the step's global token count; the
    schedule backpropagates it times ``grad_scale``. ``aux_weight`` > 0 adds each MoE chunk's
    load-balancing loss times ``aux_weight`` (x ``grad_scale`` in the gradient) per micro-batch.
    ``pp_rank``: this rank's index in ``pp_group`` (default: looked up)."""
    import torch.distributed.pipelining
    from torch.distributed.pipelining import PipelineStage

    group_rank = dist.get_rank(group=pp_group)
    if pp_rank is not None and pp_rank != group_rank:
        raise AutoparError("pp_rank", pp_rank, f"pass this process's rank in pp_group ({group_rank})",
                           problem="differs from the pipeline group's rank")
    if dist.get_world_size(group=pp_group) != layout.pp:
        raise AutoparError("pp_group", f"{dist.get_world_size(group=pp_group)} ranks",
                           f"use the mesh's pp group of layout.pp={layout.pp} ranks",
                           problem="is not the pipeline")
    indices = rank_chunks(layout, group_rank)
    if len(chunks) != len(indices):
        raise AutoparError("chunks", f"{len(chunks)} modules",
                           f"pass split_model(model, layout, {group_rank})",
                           problem=f"but pipeline rank {group_rank} runs {len(indices)} stages")
    _check_splittable(chunks[0], layout.pp)
    hf = is_hf_stage(chunks[0])
    spec = _hf_spec(chunks[0]) if hf else chunks[0].spec
    check_pipeline(layout, spec, n_microbatches, hf=hf)
    for part in chunks:
        if aux_weight and _has_moe(part) and not hasattr(part, "autopar_aux"):
            _add_aux_loss(part, aux_weight, grad_scale)
    n = num_chunks(layout)
    stages = [PipelineStage(m, c, n, device, group=pp_group) for m, c in zip(chunks, indices)]
    scaled = loss_fn if grad_scale == 1.0 else (lambda out, tgt: loss_fn(out, tgt) * grad_scale)
    facts = SCHEDULES[layout.schedule]  # the torch class of each schedule: planner/cost/pipeline.py
    cls = getattr(torch.distributed.pipelining, facts.torch_class)
    schedule = cls(stages if facts.looped else stages[0], n_microbatches, loss_fn=scaled, scale_grads=False)
    schedule.autopar_step = _StepInfo(grad_scale, n_microbatches)  # read back by pipeline_step
    return schedule, stages


def pipeline_step(schedule, stages: list, tokens: torch.Tensor | None,
                  targets: torch.Tensor | None, is_first: bool, is_last: bool) -> float:
    """Run one step's forwards and backwards (gradients accumulate in the chunks' parameters).

    ``tokens`` [n_microbatches x mbs, S] are needed on the first pipeline rank only, ``targets`` on the
    last only. Returns this rank's share of the step loss, unscaled by ``grad_scale``: on the last rank
    the sum of the micro-batch losses (``loss_fn``'s values), plus on every rank ``aux_weight x`` the
    MoE aux losses of its chunks' micro-batches; the sum over all pipeline and data-parallel ranks
    (an all-reduce the caller does) is the step's loss, as :func:`executor.reference.reference_run`
    reports it."""
    recorders = [s.submod.autopar_aux for s in stages if hasattr(s.submod, "autopar_aux")]
    for r in recorders:
        r.values.clear()
    losses: list[torch.Tensor] = []
    args = (tokens,) if is_first else ()
    kwargs = {"target": targets, "losses": losses} if is_last else {}
    schedule.step(*args, **kwargs)
    share = 0.0
    for loss in losses:
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        share += float(loss.detach()) / schedule.autopar_step.grad_scale
    n = schedule.autopar_step.n_microbatches
    for r in recorders:  # the last n forwards: the first step's metadata inference runs one more
        share += r.aux_weight * float(sum(v.float() for v in r.values[-n:]))
    return share
