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

from executor.adapters import HF, ModelAdapter, get_submodule
from planner.errors import AutoparError

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")


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


def build_hf_model(config: dict[str, Any] | str | Path, *, dtype: torch.dtype = torch.float32,
                   seed: int = 0) -> nn.Module:
    """A randomly initialised ``AutoModelForCausalLM`` for ``config`` (model_type in
    :data:`SUPPORTED_MODEL_TYPES`), SDPA attention, parameters in ``dtype``.

    The weights are transformers' own initialisation drawn from a private RNG stream seeded with
    ``seed`` (the global RNG state is restored afterwards), so equal (config, seed) give equal
    weights. Under ``with torch.device("meta")`` it builds shapes only."""
    import transformers

    data = _config_dict(config)
    model_type = data.pop("model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise AutoparError("model_type", model_type, "use one of " + ", ".join(SUPPORTED_MODEL_TYPES)
                           + ", or describe the model as a ModelSpec for the built-in decoder",
                           problem="is not a Hugging Face model type the executor supports")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        data.pop(key, None)
    hf_config = transformers.AutoConfig.for_model(model_type, **data)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    return model.to(dtype)


def hf_full_state(config: dict[str, Any] | str | Path, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """The plan-independent full weights of :func:`build_hf_model` (``config``, ``seed``) by name, for
    :func:`executor.parallelize.load_full_state`: the state dict *and* the non-persistent buffers
    (the rotary ``inv_freq``), which ``state_dict()`` leaves out and ``to_empty()`` leaves uninitialised."""
    full = build_hf_model(config, seed=seed)
    return {**dict(full.named_buffers()), **full.state_dict()}


def hf_adapter(model: nn.Module) -> ModelAdapter:
    """The module paths of a supported Hugging Face causal LM (checked by :func:`check_parallelisable`)."""
    check_parallelisable(model)
    return HF


def check_parallelisable(model: nn.Module) -> None:
    """Raise AutoparError naming the first module the parallel code needs and ``model`` lacks:
    the embedding, the layer list, every layer's norms and q/k/v/o projections, its dense MLP
    (gate/up/down projections) or MoE block (``experts`` and a router ``gate``), the final norm,
    the LM head."""
    a = HF
    name = type(model).__name__
    for path in (a.embedding, a.layers, a.final_norm, a.lm_head):
        _require(model, path, name)
    layers = get_submodule(model, a.layers)
    if len(layers) == 0:
        raise AutoparError(f"{name}.{a.layers}", 0, "use a model with at least one decoder layer",
                           problem="is empty")
    for index, layer in a.layer_items(model):
        where = f"{name}.{a.layers}.{index}"
        for path in (a.attention_norm, a.ffn_norm, a.attention):
            _require(layer, path, where)
        attention = a.attention_of(layer)
        for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
            _require(attention, proj, f"{where}.{a.attention}", nn.Linear)
        _require(layer, a.mlp, where)
        ffn = a.ffn_of(layer)
        if a.is_moe(layer):
            _require(ffn, "gate", f"{where}.{a.mlp}")
        else:
            for proj in (a.gate_proj, a.up_proj, a.down_proj):
                _require(ffn, proj, f"{where}.{a.mlp}", nn.Linear)


def _require(root: nn.Module, path: str, where: str, kind: type[nn.Module] = nn.Module) -> None:
    try:
        module = get_submodule(root, path)
    except AttributeError:
        fix = ("use a Llama-style decoder (one of " + ", ".join(SUPPORTED_MODEL_TYPES)
               + ") whose modules tensor/pipeline parallelism can split")
        raise AutoparError(f"{where}.{path}", "missing", fix, problem="is not in the model") from None
    if not isinstance(module, kind):
        raise AutoparError(f"{where}.{path}", type(module).__name__,
                           f"it must be a {kind.__name__} to be sharded", problem=f"is not a {kind.__name__}")
