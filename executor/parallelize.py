"""Apply a ParallelLayout's non-pipeline dimensions to a model (chunk), with torch's own building blocks.

Order (:func:`parallelize`; each step sees the result of the previous one):

1. tensor parallel (+ sequence parallel, loss-parallel head) — ``parallelize_module`` with Colwise
   (wq/wk/wv/w1/w3, head) / Rowwise (wo/w2, embedding); every other module with weights by where it
   sits (:func:`_unsharded_styles`): SequenceParallel on the residual stream with ``sp`` (the norms),
   its TP rank's share inside attention/MLP (Qwen3's q/k norms), so each of their gradients is summed
   over exactly the TP ranks that hold a share of it;
2. context parallel — every attention all-gathers K/V over the ``cp`` group (:mod:`executor.cp`);
3. Mixture-of-Experts (:func:`apply_moe`) — routed experts ``Shard(0)`` over the ``ep`` mesh (and their
   FFN dimension over ``etp``, :mod:`executor.moe`), routing statistics over the ranks that split a
   micro-batch (cp x tp);
4. activation recompute — the plan's kind on the first N blocks of the stage (:func:`apply_recompute`);
5. data parallel — ZeRO-0: DDP (composable ``replicate``; with DTensor parameters (TP/EP) or a
   pipeline stage, :class:`GradAllReduce`); ZeRO-1: the same + ``ZeroRedundancyOptimizer``
   (:func:`build_optimizer`); ZeRO-2: FSDP2 ``fully_shard(reshard_after_forward=False)``; ZeRO-3:
   ``fully_shard(reshard_after_forward=layout.reshard_after_forward)``; HSDP over a 2-D
   (dp_replicate, dp_shard x cp) mesh when dp_replicate > 1; each block first, then the root.
   bf16 plans get FSDP2's ``MixedPrecisionPolicy`` (bf16 gathers and compute, fp32 gradient
   reduction); under ZeRO-0/1 the step runs in ``torch.autocast(bf16)`` (:func:`autocast_context`).
   Either way parameters, gradients and optimizer states stay fp32 (master weights). fp16 (needs loss
   scaling) and fp8 (needs Transformer Engine / torchao float8 kernels) are refused. Optimizer offload is
   FSDP2's ``CPUOffloadPolicy`` (ZeRO-2/3 only).

Mesh (:func:`build_mesh`): dims ``(pp, dp_replicate, dp_shard, cp, tp)``, outermost first, every dim
kept even at size 1 (so every named sub-mesh exists under every plan). The routed experts of a MoE
model live on a second mesh over the same ranks, MoE parallel folding (Liu et al. 2025, Megatron-Core's
``--expert-tensor-parallel-size``): the dp_shard x cp x tp ranks of each (pp, dp_replicate) block,
refactored as ``(edp, ep, etp)`` with etp innermost (:meth:`Meshes.add_moe`; the folding rule is
:meth:`ParallelLayout.expert_fold_problem`). An EP group is ep ranks at stride etp (it may cross data,
context and tensor-parallel ranks: each rank dispatches the rows it routed), an ETP group etp
consecutive ranks (etp = tp: the TP group), and the ranks holding the same expert shard — the
``expert_dp`` group, data parallel for the experts (all-reduce or FSDP) — are the dp_replicate x
edp ranks at stride ep x etp. With tp > 1 the MoE input is the TP rank's sequence-parallel share
(SP is required, as in Megatron); the router is whole on every TP rank and sees only its rows, so its
gradient is summed over TP like the other weights a TP plan leaves whole (:func:`_rank_share_style`);
the shared experts are split over TP like the dense MLP (w1/w3 by FFN rows, w2 by FFN columns: 1/tp of
their weights per rank, on the all-gathered rows, output reduce-scattered; no TP sum).

Gradient convention (:func:`loss_scale`): each rank's loss is its token-loss sum / the step's global
token count, times N = dp_replicate x dp_shard x cp (the ranks DDP/FSDP average over). Averaging N
copies of N x (local share) gives the sum of the shares: the single-process gradient of the mean loss
over the global batch. Expert shards under EP already receive the gradient of every rank of their EP
group (and, with etp > 1, of every rank of their ETP group) through the all-to-all, so their reduction
over the expert_dp holders divides by N too, not by the number of holders: the sum over the
holders covers every rank of the fold once, each contributing N x its share.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from executor.adapters import ModelAdapter, builtin_adapter, get_submodule, is_mla, norm_width
from executor.hf_pipeline import is_hf_stage
from executor.measure import label
from planner.contracts import ModelSpec, ParallelLayout, Precision, Recompute, StageRecompute, TrainingConfig
from planner.cost.pipeline import SCHEDULES
from planner.errors import AutoparError
from planner.targets import Job, Target, check


# ---------------------------------------------------------------- mesh
@dataclass
class Meshes:
    """The one mesh authority: the world ``DeviceMesh`` and its named (flattened) sub-meshes.

    ``meshes[name]`` gives a dim of the world mesh (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``,
    ``tp``) or one of the sub-meshes :func:`build_mesh` flattens: ``dp`` (ranks reading different
    data), ``dp_shard_cp`` (the FSDP shard group), ``dp_cp`` (every rank holding the same dense
    parameters), with dp_replicate > 1 under ZeRO-2/3 the 2-D HSDP mesh ``hsdp``; for a MoE model
    (:meth:`add_moe`) the expert mesh's ``edp``, ``ep``, ``etp``, ``ep_etp`` and ``expert_dp`` (every
    rank holding the same expert shard; ``expert_hsdp`` for HSDP) and the token group ``cp_tp``.
    :func:`build_mesh` returns this rather than the bare DeviceMesh so that the flattened meshes are
    book-kept in one place (torch deprecates slicing flattened dims off the root mesh)."""

    world: DeviceMesh
    layout: ParallelLayout
    _named: dict[str, DeviceMesh] = field(default_factory=dict)
    _moe_added: bool = False

    def __getitem__(self, name: str) -> DeviceMesh:
        return self._named[name] if name in self._named else self.world[name]

    def _flatten(self, name: str, dims: tuple[str, ...]) -> None:
        self._named[name] = self.world[dims]._flatten(name)

    def coord(self, name: str) -> tuple[int, int]:
        """(rank, size) of this process along a named (or flattened) dimension."""
        m = self[name]
        return m.get_local_rank(), m.size()

    @property
    def has_experts(self) -> bool:
        """Whether the routed experts are sharded on the folded expert mesh (:meth:`add_moe`)."""
        return "expert_dp" in self._named

    def fsdp(self) -> DeviceMesh:
        """FSDP mesh of dense parameters: 1-D ``dp_shard_cp``, or 2-D ``hsdp`` when dp_replicate > 1."""
        return self["hsdp"] if self.layout.dp_replicate > 1 else self["dp_shard_cp"]

    def expert_fsdp(self) -> DeviceMesh:
        """FSDP mesh of the sharded expert weights: 1-D ``edp``, or 2-D ``expert_hsdp``."""
        return self["expert_hsdp"] if self.layout.dp_replicate > 1 else self["edp"]

    def add_moe(self) -> None:
        """The meshes of a MoE model, once (collective: every rank calls it at the same point). With
        ep > 1 or tp > 1 the folded expert mesh (pp, dp_replicate, edp, ep, etp): the flat block of
        dp_shard x cp x tp ranks refactored with etp innermost (module docstring); with cp x tp > 1
        the token group ``cp_tp`` (the ranks splitting one micro-batch's positions)."""
        lay = self.layout
        if self._moe_added:
            return
        self._moe_added = True
        if lay.cp * lay.tp > 1:
            self._flatten("cp_tp", ("cp", "tp"))
        if lay.ep == 1 and lay.tp == 1:
            return
        sizes, names = expert_mesh_shape(lay)
        key = (id(self.world), sizes)
        if key not in _EXPERT_MESHES or _EXPERT_MESHES[key][0] is not self.world:
            fold = self.world[("dp_shard", "cp", "tp")]._flatten("expert_fold")
            inner = fold._unflatten(0, sizes[2:], names[2:])
            mesh = DeviceMesh._concatenate([self.world[("pp", "dp_replicate")], inner])
            named = {name: mesh[name] for name in ("edp", "ep", "etp")}
            named["ep_etp"] = mesh[("ep", "etp")]
            # one flattened name per expert shape: the root mesh keeps a name for one layout only
            named["expert_dp"] = mesh[("dp_replicate", "edp")]._flatten("expert_dp_" + "x".join(map(str, sizes)))
            named["expert_hsdp"] = mesh[("dp_replicate", "edp")]
            _EXPERT_MESHES[key] = (self.world, named)
        named = _EXPERT_MESHES[key][1]
        self._named.update({k: v for k, v in named.items() if k != "expert_hsdp"})
        if lay.dp_replicate > 1 and lay.zero_stage >= 2:
            self._named["expert_hsdp"] = named["expert_hsdp"]


_WORLD_MESHES: dict[tuple, tuple[object, DeviceMesh]] = {}  # key -> (the default group it was built on, mesh)
_EXPERT_MESHES: dict[tuple, tuple[DeviceMesh, dict[str, DeviceMesh]]] = {}  # key -> (its world mesh, named)
"""Meshes already built in this process, by world group and shape. torch frees a process group only with
the default one, and each gloo group keeps three threads and a TCP connection per peer: a process applying
several plans (a fallback's re-plan, a test worker running dozens of cases: 485 groups and 1,678 threads
per rank before this cache) reuses the groups of a shape it has built. Flattened sub-meshes are cached by
torch on their root mesh, by name."""


def world_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``init_device_mesh(device_type, shape, names)``, once per process and default group (the identity of
    the group it was built on is checked: a re-initialised world starts afresh)."""
    key = (device_type, tuple(shape), tuple(names))
    if key not in _WORLD_MESHES or _WORLD_MESHES[key][0] is not dist.group.WORLD:
        _WORLD_MESHES[key] = (dist.group.WORLD, init_device_mesh(device_type, shape, mesh_dim_names=names))
    return _WORLD_MESHES[key][1]


def mesh_shape(layout: ParallelLayout) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Sizes and names of the world mesh, outermost first (the layout's ``MESH_ORDER``: TP innermost)."""
    return layout.mesh_sizes(), layout.MESH_ORDER


def expert_mesh_shape(layout: ParallelLayout) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Sizes and names of the folded expert mesh over the same ranks (``EXPERT_MESH_ORDER``: etp innermost)."""
    return layout.mesh_sizes(expert=True), layout.EXPERT_MESH_ORDER


def build_mesh(layout: ParallelLayout, world_size: int, device_type: str, *, moe: bool = False) -> Meshes:
    """The world mesh of ``layout`` with every sub-mesh the executor uses, flattened once; with ``moe``
    the MoE meshes too (:meth:`Meshes.add_moe`; else :func:`parallelize` adds them for a MoE model).

    Raises AutoparError when pp x dp_replicate x dp_shard x cp x tp differs from ``world_size`` or
    ep x etp does not fold over dp_shard x cp x tp. Collective: every rank calls it with the same layout."""
    shape, names = mesh_shape(layout)
    total = layout.pp * layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp
    if total != world_size:
        raise AutoparError(
            "layout", f"pp={layout.pp} x dp_replicate={layout.dp_replicate} x dp_shard={layout.dp_shard} "
            f"x cp={layout.cp} x tp={layout.tp} = {total}",
            f"launch {total} processes, or use a layout whose degrees multiply to {world_size}",
            problem=f"does not equal the {world_size} processes of this run")
    fold = layout.expert_fold_problem()
    if fold is not None and (moe or layout.ep > 1):
        field, value = layout.expert_fold_culprit()
        raise AutoparError(f"layout.{field}", value, "use ep and etp whose product divides dp_shard x cp x tp",
                           problem=fold)
    meshes = Meshes(world_mesh(device_type, shape, names), layout)
    # flattening creates process groups (collective): same order on every rank
    meshes._flatten("dp", ("dp_replicate", "dp_shard"))
    meshes._flatten("dp_shard_cp", ("dp_shard", "cp"))
    meshes._flatten("dp_cp", ("dp_replicate", "dp_shard", "cp"))
    if layout.dp_replicate > 1 and layout.zero_stage >= 2:  # slicing a flattened dim: only where needed
        meshes._named["hsdp"] = meshes.world[("dp_replicate", "dp_shard_cp")]
    if moe:
        meshes.add_moe()
    return meshes


def data_rank(meshes: Meshes) -> tuple[int, int]:
    """(dp_rank, dp_size): this rank's rows of the global batch (:func:`executor.data.split_batch`)."""
    return meshes.coord("dp")


def cp_rank(meshes: Meshes) -> int:
    """This rank's index in its context-parallel group."""
    return meshes["cp"].get_local_rank()


def cp_shard_batch(tokens: torch.Tensor, targets: torch.Tensor,
                   meshes: Meshes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's sequence positions of ``tokens``/``targets`` [B, S] under context parallelism:
    the load-balanced chunks r and 2cp-1-r (:func:`executor.cp.load_balanced_positions`), and the
    global positions [S/cp] the model needs for RoPE and the causal mask. cp = 1: unchanged, arange(S)."""
    seq = tokens.shape[1]
    if meshes.layout.cp == 1:
        return tokens, targets, torch.arange(seq)
    from executor.cp import load_balanced_positions

    pos = load_balanced_positions(seq, meshes.layout.cp, cp_rank(meshes))
    return tokens[:, pos.to(tokens.device)], targets[:, pos.to(targets.device)], pos


def grad_scale(layout: ParallelLayout) -> int:
    """N = dp_replicate x dp_shard x cp: the ranks the data-parallel reduction averages over; each
    rank multiplies its loss (token-loss sum / global tokens of the step) by N."""
    return layout.dp_replicate * layout.dp_shard * layout.cp


def loss_scale(meshes: Meshes) -> int:
    """:func:`grad_scale` of the mesh's layout (equals ``meshes['dp_cp'].size()``)."""
    return grad_scale(meshes.layout)


# ---------------------------------------------------------------- what this executor can run
def _spec_of(spec_or_model: ModelSpec | nn.Module) -> tuple[ModelSpec, bool]:
    """(ModelSpec, is a Hugging Face model) of a ModelSpec, a built-in decoder (it carries ``.spec``) or a
    Hugging Face model (its config read by :func:`planner.hf_config.model_spec_from_hf_config`)."""
    if isinstance(spec_or_model, ModelSpec):
        return spec_or_model, False
    spec = getattr(spec_or_model, "spec", None)
    if isinstance(spec, ModelSpec):
        return spec, False
    from planner.hf_config import model_spec_from_hf_config

    cfg = spec_or_model.config
    data = cfg.to_dict()
    for legacy, name in getattr(cfg, "attribute_map", {}).items():  # config.json's names (num_experts)
        if name in data:
            data.setdefault(legacy, data[name])
    return model_spec_from_hf_config(data), True


def check_supported(layout: ParallelLayout, spec_or_model: ModelSpec | nn.Module,
                    training: TrainingConfig | None = None, *, hf: bool = False) -> None:
    """Raise AutoparError (field, value, reason, fix) for a layout this executor cannot honour exactly,
    before any process starts: the first row of the ``autopar`` capability table
    (:data:`planner.targets.TARGETS`) that refuses it. ``hf``: the model is a Hugging Face one (no
    CP/EP/selective hooks); a module that is not the built-in decoder counts as one."""
    spec, is_hf = _spec_of(spec_or_model)
    check(Target.autopar, Job(spec, training, layout, hf=hf or is_hf))
    if is_hf:
        from executor.hf import check_parallelisable

        check_parallelisable(spec_or_model, layout)


# ---------------------------------------------------------------- tensor / sequence parallel
def _adapter(model: nn.Module) -> ModelAdapter:
    """Module paths of ``model`` (:mod:`executor.adapters`): the built-in decoder (it carries its
    ModelSpec as ``.spec``) or a Hugging Face causal LM."""
    if isinstance(getattr(model, "spec", None), ModelSpec):
        return builtin_adapter(model)
    from executor.hf import hf_adapter

    return hf_adapter(model)


def _block_plan(layout: ParallelLayout, a: ModelAdapter, hf: bool, moe: nn.Module | None = None) -> dict:
    """Megatron TP plan of one decoder layer's projections (module path -> style). Without SP the layer's
    input and output are replicated; with SP they are sequence-sharded (Shard(1)): the attention/MLP
    inputs are all-gathered and o_proj/down_proj reduce-scatter their outputs. The norms and any other
    module with weights get their style from :func:`_unsharded_styles`. ``moe``: the layer's built-in
    MoE block, planned by :func:`_moe_plan` instead of the dense MLP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    out = Shard(1) if layout.sp else Replicate()
    local = not (hf and layout.sp)  # HF with SP: the residual stream stays a DTensor (see apply_tp)
    attn, mlp = a.attention, a.mlp
    plan: dict = {f"{attn}.{p}": ColwiseParallel() for p in (a.q_proj, a.k_proj, a.v_proj)}
    plan[f"{attn}.{a.o_proj}"] = RowwiseParallel(output_layouts=out, use_local_output=local)
    if moe is not None:
        plan |= _moe_plan(layout, a, moe)
    else:
        plan[f"{mlp}.{a.gate_proj}"] = ColwiseParallel()
        plan[f"{mlp}.{a.down_proj}"] = RowwiseParallel(output_layouts=out, use_local_output=local)
        if a.up_proj is not None:  # SwiGLU's second input projection
            plan[f"{mlp}.{a.up_proj}"] = ColwiseParallel()
    if layout.sp:
        if hf:  # self_attn(hidden_states=..., ...)
            plan[attn] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()})
        else:  # Attention.forward(x, cos, sin, positions)
            plan[attn] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None))
        if moe is None:
            plan[mlp] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def _moe_plan(layout: ParallelLayout, a: ModelAdapter, moe: nn.Module) -> dict:
    """TP plan of a built-in MoE block (sequence parallel required: :data:`planner.targets.TARGETS`):
    the block takes the TP rank's sequence share as a plain tensor (``MoE.forward(x, positions)``) and
    routes it itself; the router is whole on every TP rank and sees its rows only
    (:func:`_rank_share_style`: gradient summed over TP); the shared experts are a TP-split MLP
    (:class:`executor.moe.SharedExpertsParallel`: their rows all-gathered, output reduce-scattered); the
    routed experts are left to :func:`apply_moe` (the expert mesh)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    from executor.moe import SharedExpertsParallel

    if not layout.sp:
        raise AutoparError("layout.sp", False, "set sp=True for a MoE model with tp > 1",
                           problem="is needed by the MoE layers under tensor parallelism (each TP rank "
                           "routes its sequence-parallel share of the tokens)")
    plan: dict = {a.moe: PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Shard(1), None), use_local_output=True),
                  f"{a.moe}.gate": _rank_share_style()}
    if moe.shared_experts is not None:
        plan[f"{a.moe}.shared_experts"] = SharedExpertsParallel()
    return plan


def _rank_share_style():
    """The style of a module with weights inside an attention or MLP block that no projection shards
    (Qwen3's per-head q/k norms). Between the column- and the row-parallel projections every activation
    is this rank's share (its heads, its FFN columns), so such a module's weights, whole on every TP
    rank, see only this rank's share of the data their gradient sums over: summed over the TP group it is
    the single-process gradient. The weights become ``Replicate()`` DTensors and the local input is taken
    as this rank's block of batch rows (``Shard(0)``) of a tensor spread over the TP group; the module
    treats rows alike, so its local output is unchanged (returned as a plain tensor), and the weight
    gradient, a sum over rows, comes out ``Partial`` and is summed over TP wherever it is brought to the
    parameter's placement (:meth:`GradAllReduce.sync`, FSDP2's reduction)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return SequenceParallel(sequence_dim=0, use_local_output=True)


def _row_norm_style():
    """The style of a norm over a whole column-split projection (OLMo 2's q/k norms): its weight is
    ``Replicate()`` and its input this rank's columns (``Shard(-1)``), so the mean of squares is reduced
    over the TP group by DTensor and each rank scales its own columns; the output is local again."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return SequenceParallel(sequence_dim=-1, use_local_output=True)


def _region_style(block: nn.Module, region: str, module: nn.Module, a: ModelAdapter | None):
    """:func:`_row_norm_style` for a norm over a whole q/k projection of the attention
    (:func:`executor.adapters.norm_width`), else :func:`_rank_share_style`."""
    if a is not None and region == a.attention and norm_width(get_submodule(block, region), module, a) == "row":
        return _row_norm_style()
    return _rank_share_style()


def _unsharded_styles(root: nn.Module, plan: dict, regions: tuple[str, ...], sp: bool,
                      skip: tuple[str, ...] = (), a: ModelAdapter | None = None) -> dict:
    """A style for every module of ``root`` that owns parameters and that ``plan`` does not name (paths
    under ``skip`` excepted), so that no weight left whole on the TP ranks gets a wrong gradient:

    * inside one of ``regions`` (a layer's attention and MLP): :func:`_region_style`;
    * elsewhere, on the residual stream: with SP the stream is sequence-sharded, so ``SequenceParallel``
      (weights ``Replicate()``, gradient ``Partial`` and summed over TP); without SP every TP rank runs
      the module on the same whole input and already holds the whole gradient: no style."""
    from torch.distributed.tensor.parallel import SequenceParallel

    styles: dict = {}
    for path, module in root.named_modules():
        if not path or path in plan or path.startswith(skip) or next(module.parameters(False), None) is None:
            continue
        region = next((r for r in regions if path.startswith(f"{r}.")), None)
        if region is not None:
            styles[path] = _region_style(root, region, module, a)
        elif sp:
            styles[path] = SequenceParallel()
    return styles


def apply_tp(model: nn.Module, layout: ParallelLayout, tp_mesh: DeviceMesh, *,
             hf: bool | None = None) -> None:
    """Megatron-style TP (+SP) on every decoder layer, the embedding (row-wise: vocabulary-sharded
    table) and the head (column-wise), module paths from the model's adapter; every other module with
    weights (the norms, Qwen3's q/k norms) styled by :func:`_unsharded_styles`. The head's output stays a
    DTensor sharded over the vocabulary, so the cross-entropy must run under :func:`loss_context`
    (loss-parallel: no all-gather of the logits).

    Hugging Face with SP: the HF model derives its causal mask and position ids from the embedding
    output's shape, so the embedding (and every o_proj/down_proj) returns a sequence-sharded DTensor
    whose shape is the full sequence; the built-in model takes positions explicitly and passes plain
    local tensors between layers, as torchtitan does. ``hf``: whether ``model`` is a Hugging Face one
    (None: told by the model)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    a = _adapter(model)
    hf = a.family == "hf" if hf is None else hf
    sp = layout.sp
    top: dict = {}
    if hf and sp and is_hf_stage(model):  # hidden states between chunks: this rank's sequence shard
        model.autopar_sp_mesh = tp_mesh
    if _has(model, a.embedding):
        top[a.embedding] = RowwiseParallel(input_layouts=Replicate(),
                                           output_layouts=Shard(1) if sp else Replicate(),
                                           use_local_output=not (hf and sp))
    if a.lm_head is not None and _has(model, a.lm_head):
        top[a.lm_head] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                         output_layouts=Shard(-1), use_local_output=False)
    top |= _unsharded_styles(model, top, (), sp, skip=(f"{a.layers}.",))
    tied = _tied_head(model, a)
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied:  # both styles shard the [vocab, hidden] table by rows: one Shard(0) parameter serves both
        get_submodule(model, a.lm_head).weight = get_submodule(model, a.embedding).weight
    for _, block in a.layer_items(model):
        if hf and a.is_moe(block):
            _tp_hf_moe_block(block, layout, a, tp_mesh)
            continue
        moe = a.ffn_of(block) if not hf and a.is_moe(block) else None
        plan = _with_mla(block, _block_plan(layout, a, hf, moe), a)
        skip = (f"{a.moe}.",) if moe is not None else ()  # the experts: apply_moe
        plan |= _unsharded_styles(block, plan, (a.attention, a.mlp), sp, skip=skip, a=a)
        parallelize_module(block, tp_mesh, plan)
        _after_tp(block, a, tp_mesh)


def _with_mla(block: nn.Module, plan: dict, a: ModelAdapter) -> dict:
    """``plan`` with a multi-head latent attention's projections in place of q/k/v (:mod:`executor.hf_mla`)."""
    attention = get_submodule(block, a.attention)
    if not is_mla(attention):
        return plan
    from executor.hf_mla import mla_plan

    qkv = {f"{a.attention}.{p}" for p in (a.q_proj, a.k_proj, a.v_proj)}
    return {k: v for k, v in plan.items() if k not in qkv} | mla_plan(attention, a.attention)


def _after_tp(block: nn.Module, a: ModelAdapter, tp_mesh: DeviceMesh) -> None:
    """What a layer needs once parallelised: MLA's shared rotary key's gradient summed over TP."""
    attention = get_submodule(block, a.attention)
    if is_mla(attention):
        from executor.hf_mla import sum_rotary_key_grad_over_tp

        sum_rotary_key_grad_over_tp(attention, tp_mesh.get_group())


def _tp_hf_moe_block(block: nn.Module, layout: ParallelLayout, a: ModelAdapter, tp_mesh: DeviceMesh) -> None:
    """A Hugging Face MoE layer under TP + SP: the attention as in a dense layer; the MoE block routes the
    rank's sequence shard (:func:`executor.hf_moe.tp_block_style`), its routed experts whole on the folded
    expert mesh (their gradient reduced over it, TP ranks included), its router's gradient summed over TP
    (:func:`executor.hf_moe.sum_router_grad_over_tp`), its shared experts rank-shared like Qwen3's q/k norms."""
    from torch.distributed.tensor.parallel import parallelize_module

    from executor.hf_moe import sum_router_grad_over_tp, tp_block_style

    plan = _with_mla(block, _block_plan(layout, a, True, None), a)
    for key in [k for k in plan if k == a.mlp or k.startswith(f"{a.mlp}.")]:
        del plan[key]  # the dense MLP's entries
    plan[a.mlp] = tp_block_style()
    skip = (f"{a.mlp}.experts", f"{a.mlp}.gate")
    plan |= _unsharded_styles(block, plan, (a.attention, a.mlp), layout.sp, skip=skip, a=a)
    parallelize_module(block, tp_mesh, plan)
    sum_router_grad_over_tp(get_submodule(block, f"{a.mlp}.gate"), tp_mesh.get_group())
    _after_tp(block, a, tp_mesh)


def _tied_head(model: nn.Module, a: ModelAdapter) -> bool:
    """Whether the LM head module and the embedding hold the same weight (a tied Hugging Face model)."""
    if a.lm_head is None or not (_has(model, a.lm_head) and _has(model, a.embedding)):
        return False
    return get_submodule(model, a.lm_head).weight is get_submodule(model, a.embedding).weight


def _has(model: nn.Module, path: str) -> bool:
    """Whether ``path`` names a module of ``model`` (a pipeline stage sets the ones it lacks to None, a
    Hugging Face one its norm and head to ``nn.Identity``)."""
    try:
        return not isinstance(get_submodule(model, path), nn.Identity)
    except AttributeError:
        return False


def loss_context(layout: ParallelLayout) -> contextlib.AbstractContextManager:
    """Enter around loss and backward: with tp > 1 the logits are vocabulary-sharded and torch's
    ``loss_parallel`` computes the cross-entropy from the shards (max and sum-exp all-reduced)."""
    if layout.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def add_aux_loss(loss: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """``loss + aux`` where ``loss`` may be the replicated DTensor of the loss-parallel cross-entropy
    (tp > 1) and ``aux`` is this rank's plain MoE load-balancing term: ``aux`` joins as the local value
    of a DTensor of the loss's placements, so the backward hands it the plain gradient of its own term."""
    from torch.distributed.tensor import DTensor

    if isinstance(loss, DTensor):
        aux = DTensor.from_local(aux, loss.device_mesh, loss.placements, run_check=False)
    return loss + aux


# ---------------------------------------------------------------- context / expert parallel
def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Every attention of the built-in model attends over the whole sequence of the cp group
    (:func:`executor.cp.cp_attention`); the caller feeds each rank its positions (:func:`cp_shard_batch`;
    a Hugging Face model through :func:`executor.hf_cp.set_positions`)."""
    if not isinstance(getattr(model, "spec", None), ModelSpec):
        from executor.hf_cp import apply_hf_cp

        apply_hf_cp(model, cp_mesh.get_group())
        return
    for block in model.layers.values():
        block.attention.cp_group = cp_mesh.get_group()


def apply_moe(model: nn.Module, layout: ParallelLayout, meshes: Meshes) -> None:
    """The MoE blocks of the built-in ``model`` on the folded expert mesh (module docstring): experts
    sharded over ``ep`` (and ``etp``) when the expert mesh exists, and with cp x tp > 1 routing
    statistics over the token group ``cp_tp`` (the TP rank's rows are its sequence-parallel chunk)."""
    from executor.moe import apply_expert_parallel, apply_token_split

    meshes.add_moe()
    if meshes.has_experts:
        apply_expert_parallel(model, meshes["ep"] if layout.expert_tp == 1 else meshes["ep_etp"])
    if layout.cp * layout.tp > 1:
        shard = (meshes["tp"].get_local_rank(), layout.tp) if layout.tp > 1 else None
        apply_token_split(model, meshes["cp_tp"].get_group(), shard, 1.0 / layout.cp)


def apply_hf_moe(model: nn.Module, layout: ParallelLayout, meshes: Meshes) -> None:
    """A Hugging Face MoE model's routed experts on the folded expert mesh (their gradient reduced over
    ``expert_dp``), sharded over its ``ep`` dimension when ep > 1 (:mod:`executor.hf_moe`; the experts'
    FFN is not split over TP: etp must be 1)."""
    from executor.hf_moe import apply_hf_expert_parallel

    meshes.add_moe()
    if layout.ep > 1:
        apply_hf_expert_parallel(model, meshes["ep"])


def _has_hf_experts(model: nn.Module) -> bool:
    if isinstance(getattr(model, "spec", None), ModelSpec):
        return False
    a = _adapter(model)
    return any(a.is_moe(layer) for _, layer in a.layer_items(model))


def _is_builtin_moe(model: nn.Module) -> bool:
    spec = getattr(model, "spec", None)
    return isinstance(spec, ModelSpec) and spec.moe is not None


# ---------------------------------------------------------------- recompute
def apply_recompute(model: nn.Module, choice: StageRecompute | None, layout: ParallelLayout) -> None:
    """The stage's recompute on its first ``choice.num_layers`` blocks (``layout.recompute`` on every
    block when ``choice`` is None).

    full: the block is wrapped in ``checkpoint_wrapper``; only its input is kept and the whole block
    runs again in the backward. selective: only the attention core — softmax(QK^T/sqrt(d) + mask) V —
    runs under ``torch.utils.checkpoint``; the projections' inputs and outputs stay stored. That is
    Korthikanti et al.'s selective recompute: the core holds the O(s^2) activations (scores, softmax,
    its dropout mask: 5as/h per token of their formula) while costing few FLOPs to redo. op: per-op selective
    checkpointing of the whole block (:mod:`executor.sac`)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from executor.sac import op_checkpoint

    kind = choice.kind if choice is not None else layout.recompute
    if kind is Recompute.none:
        return
    a = _adapter(model)
    container = get_submodule(model, a.layers)
    items = list(a.layer_items(model))
    n = len(items) if choice is None or choice.num_layers is None else min(choice.num_layers, len(items))
    if kind is Recompute.selective and a.family == "hf":
        from executor.hf_selective import apply_hf_selective

        apply_hf_selective(model, [block for _, block in items[:n]])
        return
    for name, block in items[:n]:
        if kind is Recompute.full:
            container.add_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
        elif kind is Recompute.op:
            container.add_module(name, op_checkpoint(block))
        else:
            a.attention_of(block).recompute_core = True


# ---------------------------------------------------------------- data parallel
def _mp_policy(training: TrainingConfig | None):
    """bf16 parameters in forward/backward with fp32 gradient reduction; fp32 keeps fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if training is not None and training.precision is Precision.bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def autocast_context(layout: ParallelLayout, training: TrainingConfig, device: torch.device):
    """bf16 mixed precision where FSDP2 does not provide it (ZeRO-0/1: DDP, gradient all-reduce,
    ZeroRedundancyOptimizer): ``torch.autocast`` runs matmuls in bf16 while parameters stay fp32.
    Entered around forward and backward (a pipeline schedule interleaves them)."""
    if training.precision is Precision.bf16 and layout.zero_stage < 2:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def apply_fsdp(model: nn.Module, layout: ParallelLayout, meshes: Meshes,
               training: TrainingConfig | None) -> None:
    """ZeRO-2/3 and HSDP with FSDP2: each block (its routed experts first, on the expert mesh), then the root.

    ZeRO-2 keeps the gathered parameters from forward to backward (reshard_after_forward=False):
    one all-gather per step, gradients and optimizer states sharded. ZeRO-3 frees them after forward
    when ``layout.reshard_after_forward``, except under the zero-bubble schedules: their split weight pass
    takes the stage's parameters when it runs, and resharded ones are not the tensors the forward used
    (every weight gradient of the stage was lost); a pipeline stage holds its weights gathered anyway
    (``planner.cost.memory.kept_gathered_bytes_per_param``). Offload: ``CPUOffloadPolicy`` keeps sharded parameters,
    gradients and optimizer states on the CPU and steps there (on a CPU-only machine a no-op move)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, register_fsdp_forward_method

    kw: dict = {"mp_policy": _mp_policy(training),
                "reshard_after_forward": layout.zero_stage == 3 and layout.reshard_after_forward
                and not (layout.pp > 1 and SCHEDULES[layout.schedule].split_backward)}
    if layout.offload_optimizer:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    mesh = meshes.fsdp()
    a = _adapter(model)
    for _, block in a.layer_items(model):
        if meshes.has_experts and a.is_moe(block):
            experts = fully_shard(a.ffn_of(block).experts, mesh=meshes.expert_fsdp(), **kw)
            experts.set_gradient_divide_factor(float(grad_scale(layout)))  # see the module docstring
            if meshes["edp"].size() > 1 and meshes.world.device_type != "cuda":
                # gloo has no PREMUL_SUM: reduce-scatter with SUM, then divide. (Not with a 1-rank shard
                # group: torch 2.13 then divides twice, and no reduce-scatter runs anyway.)
                experts.set_force_sum_reduction_for_comms(True)
            if hasattr(experts, "forward_grouped"):  # the built-in MoE calls it instead of forward
                register_fsdp_forward_method(experts, "forward_grouped")
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)


class GradAllReduce(nn.Module):
    """Plain data parallelism for what DDP cannot wrap — DTensor parameters (TP/EP) and pipeline stages:
    after the last backward of a step, :meth:`sync` averages every gradient over the ranks holding the
    same parameter (``dp_cp`` for dense weights, ``expert_dp`` for expert shards), dividing by N
    (:func:`grad_scale`) for both (the module docstring says why)."""

    def __init__(self, module: nn.Module, meshes: Meshes) -> None:
        super().__init__()
        self.module = module
        self.scale = grad_scale(meshes.layout)
        expert_mesh = meshes["expert_dp"] if meshes.has_experts else None
        dense = meshes["dp_cp"]
        self._meshes = {name: expert_mesh if expert_mesh is not None and ".experts." in name else dense
                        for name, _ in module.named_parameters()}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync(self) -> None:
        """All-reduce (sum) each local gradient over its group and divide by N. A DTensor gradient left
        Partial over the TP mesh (norms, Qwen3's q/k norms: :func:`_unsharded_styles`) is first reduced
        to the parameter's placement."""
        from torch.distributed.tensor import DTensor

        for name, p in self.module.named_parameters():
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(placements=p.placements)
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            mesh = self._meshes[name]
            if mesh.size() > 1:
                with label("autopar.dp_grad"):
                    dist.all_reduce(g, group=mesh.get_group())
            if self.scale > 1:
                g.div_(self.scale)


def needs_manual_sync(layout: ParallelLayout) -> bool:
    """ZeRO-0/1 where DDP cannot be used: DTensor parameters (tp/ep > 1) or a pipeline stage."""
    return layout.zero_stage < 2 and (layout.tp > 1 or layout.ep > 1 or layout.pp > 1)


def apply_data_parallel(model: nn.Module, layout: ParallelLayout, meshes: Meshes,
                        training: TrainingConfig | None = None,
                        device: torch.device | None = None) -> nn.Module:
    """Data parallelism of ``layout.zero_stage``; returns the module to call.

    ZeRO-2/3: FSDP2 in place (:func:`apply_fsdp`), returns ``model``. ZeRO-0/1 with DTensor parameters
    or a pipeline stage: a :class:`GradAllReduce` wrapper (call its ``sync()`` after the last backward).
    Otherwise torch's composable DDP (``replicate``, in place; it builds its DDP at the first forward, so
    it may be applied to a meta model before :func:`load_full_state`) over the ``dp_cp`` group, which
    averages gradients in buckets during the backward."""
    if layout.zero_stage >= 2:
        apply_fsdp(model, layout, meshes, training)
        return model
    if needs_manual_sync(layout):
        return GradAllReduce(model, meshes)
    group = meshes["dp_cp"]
    if group.size() == 1:
        return model
    from torch.distributed._composable.replicate import replicate

    if meshes.world.device_type != "cuda":
        return replicate(model, process_group=group.get_group())
    device_id = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    return replicate(model, process_group=group.get_group(), device_id=device_id)


def accumulation_cadence(model: nn.Module, layout: ParallelLayout, is_last_microbatch: bool) -> None:
    """Before each micro-batch's forward, the data-parallel collectives it runs, as the cost model prices
    them (:func:`planner.cost.predict.dp_cadence`): DDP (``replicate``) all-reduces only on the last
    micro-batch (:class:`GradAllReduce` only in ``sync()``); ZeRO-2 keeps its gathered weights until the
    last micro-batch's backward (one all-gather per step) and ZeRO-2/3 reduce-scatter every micro-batch
    (holding unsharded gradients across micro-batches is memory no plan counts)."""
    if layout.zero_stage < 2 and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(is_last_microbatch)
    elif layout.zero_stage == 2 and hasattr(model, "set_reshard_after_backward"):
        model.set_reshard_after_backward(is_last_microbatch)


def build_optimizer(model: nn.Module | list[nn.Module], layout: ParallelLayout, meshes: Meshes,
                    lr: float) -> torch.optim.Optimizer:
    """AdamW with :mod:`executor.reference`'s constants. ZeRO-1: ``ZeroRedundancyOptimizer`` over the
    ``dp_cp`` group (each rank keeps and updates the AdamW states of its share of the parameters and
    broadcasts them after the step). ZeRO-2/3: plain AdamW on the FSDP shards (states sharded with them)."""
    from executor.reference import BETAS, EPS, WEIGHT_DECAY, make_optimizer

    parts = model if isinstance(model, list) else [model]
    params = [p for part in parts for p in part.parameters()]
    group = meshes["dp_cp"]
    if layout.zero_stage == 1 and group.size() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW,
                                       process_group=group.get_group(),
                                       lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    return make_optimizer(params, lr)


# ---------------------------------------------------------------- everything, in order
def parallelize(model: nn.Module, layout: ParallelLayout, meshes: Meshes, *, training: TrainingConfig | None,
                stage_recompute: StageRecompute | None = None) -> nn.Module:
    """TP(+SP) -> CP -> MoE -> recompute -> DDP/ZeRO/FSDP on ``model`` (best on the meta device; then
    :func:`load_full_state`). Returns the module to call (``model`` or its :class:`GradAllReduce`)."""
    if layout.tp > 1:
        apply_tp(model, layout, meshes["tp"])
    if layout.cp > 1:
        apply_cp(model, meshes["cp"])
    if _is_builtin_moe(model):
        apply_moe(model, layout, meshes)
    elif layout.ep > 1 or (layout.tp > 1 and _has_hf_experts(model)):
        apply_hf_moe(model, layout, meshes)
    apply_recompute(model, stage_recompute, layout)
    return apply_data_parallel(model, layout, meshes, training)


# ---------------------------------------------------------------- weights
def load_full_state(model: nn.Module, full_sd: dict[str, torch.Tensor], device: torch.device,
                    offload: bool = False) -> None:
    """Allocate ``model``'s (sharded) parameters on ``device`` (``to_empty``) and load the plan-independent
    full weights: every rank passes the same full tensors and keeps its shard
    (``set_model_state_dict(full_state_dict=True)``). Names missing from ``model`` (another pipeline
    stage's) are skipped; a name of ``model``'s state dict missing from ``full_sd`` is an error (strict).

    ``to_empty`` leaves buffers uninitialised too: a non-persistent buffer (a Hugging Face model's rotary
    ``inv_freq``) is copied from ``full_sd`` when given there under its name (``named_buffers()`` of
    the full model). With ``offload`` (FSDP2's ``CPUOffloadPolicy``) the sharded parameters live on the host:
    they are allocated there and the buffers on ``device`` (allocated on the GPU, the first ``state_dict()``
    refused them: "Attempted to set the storage of a tensor on device cpu to a storage on cuda:0", H200, torch
    2.11, 2026-11-27)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    target = model.module if isinstance(model, GradAllReduce) else model
    target.to_empty(device="cpu" if offload else device)
    if offload and device.type != "cpu":
        for module in target.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                module._buffers[name] = buf.to(device)  # noqa: SLF001 - a buffer moves alone, its parameters stay
    names = {clean_fqn(k) for k in target.state_dict()}
    mine = {k: v for k, v in full_sd.items() if k in names}
    set_model_state_dict(target, mine, options=StateDictOptions(full_state_dict=True, strict=True))
    with torch.no_grad():
        for name, buf in target.named_buffers():
            full = full_sd.get(clean_fqn(name))
            if full is not None and clean_fqn(name) not in names:
                buf.copy_(full)


def materialise(parts: list[nn.Module], full_sd: dict[str, torch.Tensor], device: torch.device,
                offload: bool = False) -> None:
    """:func:`load_full_state` for each model chunk of this rank."""
    for part in parts:
        load_full_state(part, full_sd, device, offload)


def clean_fqn(name: str) -> str:
    """The plan-independent parameter name: wrapper prefixes (recompute, DDP) removed."""
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")
