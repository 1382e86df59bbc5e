"""Hugging Face decoder models built from a config, with random weights and nothing downloaded.

:func:`build_hf_model` turns a ``config.json`` (dict or path) into a ``transformers`` causal LM
(SDPA attention) whose weights are drawn from ``seed`` alone, so every rank and every plan starts
from the same numbers. :func:`check_parallelisable` checks, before any process starts, that the
module tree has what the tensor/pipeline-parallel code expects (:data:`executor.adapters.HF`).
The forward is ``model(input_ids).logits`` [B, S, V].
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from executor.adapters import HF, ModelAdapter, get_submodule, is_mla, norm_width
from planner.contracts import ParallelLayout
from planner.errors import AutoparError


def _config_dict(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise AutoparError("--hf-config", str(path), "pass the path of a config.json",
                           problem="does not exist" if not path.exists() else "is not a file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AutoparError("--hf-config", str(path), "pass a valid config.json",
                           problem=f"is not readable JSON ({err})") from err
    if not isinstance(data, dict):
        raise AutoparError("--hf-config", str(path), "a config.json holds one JSON object",
                           problem=f"holds a JSON {type(data).__name__}")
    return data


def _hf_config(model_type: object, data: dict[str, Any]):  # noqa: ANN202 - a transformers PretrainedConfig
    """transformers' config class for ``model_type`` filled from ``data``; an unknown type is refused
    naming the value."""
    import transformers

    if not isinstance(model_type, str) or not model_type:
        raise AutoparError("model_type", model_type, "set model_type to the config's transformers model type "
                           "(llama, qwen3, gemma2, olmo2, granite, phi3, ...)", problem="is missing or not a string")
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as err:
        raise AutoparError("model_type", model_type, f"use a model type transformers {transformers.__version__} "
                           "knows (llama, qwen3, gemma2, olmo2, granite, phi3, ...)",
                           problem=f"is not known to transformers ({err})") from None


def _from_config(hf_config, model_type: str) -> nn.Module:  # noqa: ANN001 - a transformers PretrainedConfig
    """``AutoModelForCausalLM.from_config`` with SDPA attention, or the model's eager attention where
    transformers gives it no SDPA path (Gemma 2's soft-capped scores); anything else it refuses (not a
    causal LM, an inconsistent config) becomes an AutoparError naming the model type."""
    import transformers

    build = transformers.AutoModelForCausalLM.from_config
    try:
        try:
            return build(hf_config, attn_implementation="sdpa")
        except ValueError as err:
            if "scaled_dot_product_attention" not in str(err):
                raise
            return build(hf_config, attn_implementation="eager")
    except (ValueError, AssertionError, TypeError, KeyError) as err:
        raise AutoparError("model_type", model_type, "pass the config.json of a decoder-only causal LM whose "
                           "fields transformers accepts", problem=f"cannot be built as a causal LM ({err})") from None


def build_hf_model(config: dict[str, Any] | str | Path, *, dtype: torch.dtype = torch.float32,
                   seed: int = 0) -> nn.Module:
    """A randomly initialised ``AutoModelForCausalLM`` for ``config`` (any ``model_type`` transformers
    builds as a causal LM; what each plan dimension can do with it is decided from its modules by
    :func:`check_parallelisable`), SDPA attention where transformers has it, parameters in ``dtype``.

    No KV cache (``use_cache=False``): with one, a layer recomputed in the backward appended its keys a
    second time and attended over both copies (Gemma 2/3 raised on the mask's size; Llama's shapes let it run).

    The weights are transformers' own initialisation drawn from a private RNG stream seeded with
    ``seed`` (the global RNG state is restored afterwards), so equal (config, seed) give equal
    weights. Under ``with torch.device("meta")`` it builds shapes only."""
    data = _config_dict(config)
    model_type = data.pop("model_type", None)
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        data.pop(key, None)
    hf_config = _hf_config(model_type, data)
    hf_config.use_cache = False  # training: a KV cache would grow again when a recomputed layer reruns
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _from_config(hf_config, model_type)
    return model.to(dtype)


def hf_full_state(config: dict[str, Any] | str | Path, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """The plan-independent full weights of :func:`build_hf_model` (``config``, ``seed``) by name, for
    :func:`executor.parallelize.load_full_state`: the state dict *and* the non-persistent buffers
    (the rotary ``inv_freq``), which ``state_dict()`` leaves out and ``to_empty()`` leaves uninitialised."""
    full = build_hf_model(config, seed=seed)
    return {**dict(full.named_buffers()), **full.state_dict()}


def hf_adapter(model: nn.Module) -> ModelAdapter:
    """The module paths of a Hugging Face causal LM (checked by :func:`check_parallelisable`; a pipeline
    chunk was checked whole before it was split)."""
    from executor.hf_pipeline import is_hf_stage

    if not is_hf_stage(model):
        check_parallelisable(model)
    return HF


FUSED = {"qkv_proj": "q, k and v", "query_key_value": "q, k and v", "Wqkv": "q, k and v",
         "gate_up_proj": "gate and up"}
"""Fused projections (Phi-3, GPT-NeoX, MPT): one Linear whose output the model slices by the full
head counts, so a column split would hand each rank a mix of q, k and v (or gate and up) rows."""


def check_parallelisable(model: nn.Module, layout: ParallelLayout | None = None) -> None:
    """Raise AutoparError naming the first module a plan needs and ``model`` lacks, before any process
    starts. Every plan: the embedding, a non-empty layer list, each layer's attention and MLP, the final
    norm and the LM head. Tensor parallelism (``layout.tp > 1``) also: separate q/k/v/o projections, a
    dense MLP's gate/up/down projections, and every other weighted module of an attention being a
    per-head norm or a norm over a whole projection (:func:`executor.adapters.norm_width`)."""
    a = HF
    name = type(model).__name__
    for path in (a.embedding, a.layers, a.final_norm, a.lm_head):
        _require(model, path, name)
    if len(get_submodule(model, a.layers)) == 0:
        raise AutoparError(f"{name}.{a.layers}", 0, "use a model with at least one decoder layer",
                           problem="is empty")
    tp = layout is not None and layout.tp > 1
    if layout is not None and layout.cp > 1:
        _check_cp(model, layout.cp)
    ep = layout.ep if layout is not None else 1
    for index, layer in a.layer_items(model):
        where = f"{name}.{a.layers}.{index}"
        _require(layer, a.attention, where)
        _require(layer, a.mlp, where)
        if ep > 1 and a.is_moe(layer):
            _check_ep(a.ffn_of(layer).experts, f"{where}.{a.mlp}.experts", ep)
        if tp:
            _check_tp_attention(a.attention_of(layer), f"{where}.{a.attention}", layout.tp)
            if not a.is_moe(layer):
                _check_tp_mlp(a.ffn_of(layer), f"{where}.{a.mlp}", layout.tp)


def _check_cp(model: nn.Module, cp: int) -> None:
    from executor.hf_cp import cp_refusal

    why = cp_refusal(model)
    if why is not None:
        raise AutoparError("layout.cp", cp, "use cp=1 for this model", problem=f"cannot run its attention: {why}")


def _check_ep(experts: nn.Module, where: str, ep: int) -> None:
    from executor.hf_moe import ep_refusal

    why = ep_refusal(experts)
    if why is not None:
        raise AutoparError("layout.ep", ep, "use ep=1 for this model", problem=f"cannot dispatch {where}: it {why}")


def _refuse_fused(module: nn.Module, where: str, tp: int) -> None:
    for path, parts in FUSED.items():
        if isinstance(getattr(module, path, None), nn.Linear):
            raise AutoparError("layout.tp", tp, "use tp=1 for this model (FSDP, HSDP and pipelines run it)",
                               problem=f"cannot split {where}.{path}: it fuses the {parts} projections in one "
                               "Linear, which a column split would cut across")


def _check_tp_attention(attention: nn.Module, where: str, tp: int) -> None:
    """Separate q/k/v/o projections whose other weighted children are per-head or whole-row q/k norms."""
    a = HF
    _refuse_fused(attention, where, tp)
    if is_mla(attention):
        from executor.hf_mla import check_mla_tp

        check_mla_tp(attention, where, tp)
        return
    for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
        _require(attention, proj, where, nn.Linear, tp)
    projections = {a.q_proj, a.k_proj, a.v_proj, a.o_proj}
    for path, module in attention.named_children():
        if path in projections or next(module.parameters(), None) is None:
            continue
        if norm_width(attention, module, a) is None:
            raise AutoparError("layout.tp", tp, "use tp=1 for this model",
                               problem=f"cannot place {where}.{path} ({type(module).__name__}): its weights are "
                               "neither per head nor over a whole q/k projection")


def _check_tp_mlp(mlp: nn.Module, where: str, tp: int) -> None:
    a = HF
    _refuse_fused(mlp, where, tp)
    for proj in (a.gate_proj, a.up_proj, a.down_proj):
        _require(mlp, proj, where, nn.Linear, tp)


def _require(root: nn.Module, path: str, where: str, kind: type[nn.Module] = nn.Module, tp: int = 1) -> None:
    try:
        module = get_submodule(root, path)
    except AttributeError:
        fix = ("use tp=1 for this model (FSDP, HSDP and pipelines run it)" if tp > 1 else
               "use a decoder-only causal LM with model.embed_tokens, model.layers (each with self_attn and "
               "mlp), model.norm and lm_head")
        raise AutoparError(f"{where}.{path}", "missing", fix,
                           problem="is not in the model" + (f", and tp={tp} needs it" if tp > 1 else "")) from None
    if not isinstance(module, kind):
        raise AutoparError(f"{where}.{path}", type(module).__name__,
                           f"it must be a {kind.__name__} to be sharded", problem=f"is not a {kind.__name__}")
