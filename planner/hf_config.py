"""Build a ``ModelSpec`` from a Hugging Face transformers ``config.json``.

Supported layouts are decoder-only Llama-style models (``llama``, ``mistral``, ``qwen2``, ``qwen3``,
``granite``, ``olmo2``, ``phi3``, ``gemma2``, ``gemma3_text``), their Mixture-of-Experts relatives
(``mixtral``, ``qwen3_moe``) and DeepSeek-V3 (``deepseek_v3``: MLA attention plus shared and routed
experts). Anything else should be written as a ``ModelSpec`` by hand.

Shapes are read, and what each family adds that moves time: Gemma's gated GELU MLP (GeGLU) has
SwiGLU's three matrices and FLOPs and is read as ``ffn_kind="swiglu"``; Phi-3's fused qkv and gate-up
projections have the shapes of the separate ones. Priced (``ModelSpec`` fields, :mod:`planner.cost.layer`):
sliding-window attention (``sliding_window``, ``global_layer_every``: Mistral 7B v0.1, Gemma 2 and 3: the
windowed blocks' attention work), Gemma's two extra norms per block (``extra_norms``), the q/k norms of
Qwen3, OLMo 2 and Gemma 3 (``qk_norm``), Gemma 2's soft-capped logits (``logit_softcap``), Qwen2's Q/K/V
biases (``qkv_bias``: under per-op checkpointing they make Q, K and V addmm, kept). Not modelled, each named
here: the output projection's bias of a Llama config with ``attention_bias`` but not ``mlp_bias`` (read as
``qkv_bias``: ``h`` parameters left out, and per-op checkpointing priced as if that projection were a counted
matmul), Qwen2's optional sliding window
(``use_sliding_window``: off in the released configs); the norms' and q/k norms' own weights in the
parameter count (under 0.01%); Granite's scalar multipliers (embedding, residual, attention, logits) and
Gemma's embedding scale (one multiply each); Gemma 2's soft-capped attention scores (inside the fused
kernel where a framework has one); RoPE scaling; DeepSeek's router bias and multi-token-prediction layers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from planner.contracts.model import ModelSpec
from planner.errors import AutoparError, UnknownNameError

_DENSE = ("llama", "mistral", "qwen2", "qwen3", "granite", "olmo2", "phi3", "gemma2", "gemma3_text")
_GATED_GELU = ("gemma2", "gemma3_text")
"""Families whose gated MLP runs GELU (tanh) where Llama runs SiLU: same three matrices, same FLOPs."""
_TIED_BY_DEFAULT = ("gemma2", "gemma3_text")
"""Families whose transformers config ties the head to the embedding unless it says otherwise."""
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (*_DENSE, "mixtral", "qwen3_moe", "deepseek_v3")
_MISSING = object()


class UnsupportedModelTypeError(UnknownNameError):
    """``model_type`` is absent or not a layout autopar can read."""

    def __init__(self, value: object, known: list[str]):
        AutoparError.__init__(
            self,
            "model_type",
            value,
            "supported layouts: " + ", ".join(sorted(known)) + " (Llama-style decoders, Mixtral/Qwen3-MoE "
            "experts, DeepSeek-V3 MLA+MoE); describe other models as a ModelSpec by hand",
            problem="is not a supported config.json layout",
        )
        self.known = known


class _Reader:
    """Reads typed keys from a config dict, remembering which key fed which ``ModelSpec`` field."""

    def __init__(self, data: dict[str, Any], source: str):
        self.data = data
        self.source = source
        self.origin: dict[str, str] = {}  # ModelSpec field path -> config key

    def field(self, key: str) -> str:
        return f"{self.source}:{key}"

    def get(self, key: str, default: object = _MISSING) -> Any:
        value = self.data.get(key)
        if value is None:  # absent and explicit null mean the same in transformers configs
            if default is _MISSING:
                raise AutoparError(
                    self.field(key),
                    None,
                    f"add {key!r} to the config (every {self.model_type} config has it)",
                    problem="is missing",
                )
            return default
        return value

    @property
    def model_type(self) -> str:
        return str(self.data.get("model_type"))

    def integer(self, key: str, into: str | None = None, default: object = _MISSING) -> Any:
        """An integer (or ``default`` when absent); ``into`` names the ModelSpec field it fills."""
        value = self.get(key, default)
        if value is not default and (isinstance(value, bool) or not isinstance(value, int)):
            raise AutoparError(
                self.field(key), value, "write it as a JSON integer", problem="is not an integer"
            )
        if into is not None:
            self.origin[into] = key
        return value

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise AutoparError(
                self.field(key), value, "write it as JSON true or false", problem="is not a boolean"
            )
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.get(key, [])
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise AutoparError(
                self.field(key),
                value,
                "write it as a JSON list of layer indices",
                problem="is not a list of integers",
            )
        return value


def _load(config: dict | str | Path) -> tuple[dict[str, Any], str]:
    """The config as a dict, and a short source label for error fields."""
    if isinstance(config, dict):
        return config, "config.json"
    path = Path(config)
    if path.is_dir():  # a downloaded model folder
        path = path / "config.json"
    if not path.is_file():
        problem = "is not a file" if path.exists() else "does not exist"
        raise AutoparError("config", str(path), "pass the path of a config.json", problem=problem)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:  # ValueError: bad JSON, huge ints
        raise AutoparError(
            "config", str(path), "pass a valid config.json", problem=f"is not readable JSON ({err})"
        ) from err
    if not isinstance(data, dict):
        raise AutoparError(
            "config",
            str(path),
            "a config.json holds one JSON object of model settings",
            problem=f"holds a JSON {type(data).__name__}, not an object",
        )
    return data, path.name


def _common(r: _Reader) -> dict[str, Any]:
    """Fields shared by every supported layout (Llama-style decoder with a gated SiLU MLP)."""
    key = "hidden_activation" if "hidden_activation" in r.data else "hidden_act"
    allowed = ("gelu_pytorch_tanh", "gelu_new", "gelu") if r.model_type in _GATED_GELU else ("silu", "swish")
    act = r.get(key, allowed[0])
    if act not in allowed:
        raise AutoparError(
            r.field(key),
            act,
            f"{r.model_type} layouts use a gated MLP with {allowed[0]}: set {allowed[0]!r}",
            problem=f"is not supported for model_type {r.model_type!r}",
        )
    hidden = r.integer("hidden_size", "hidden_size")
    heads = r.integer("num_attention_heads", "num_attention_heads")
    return {
        "num_layers": r.integer("num_hidden_layers", "num_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": r.integer("num_key_value_heads", "num_kv_heads", default=heads),
        "head_dim": r.integer("head_dim", "head_dim", default=None),
        "ffn_hidden_size": r.integer("intermediate_size", "ffn_hidden_size"),
        "ffn_kind": "swiglu",
        "vocab_size": r.integer("vocab_size", "vocab_size"),
        "tied_embeddings": r.flag("tie_word_embeddings", default=r.model_type in _TIED_BY_DEFAULT),
        "position_embedding": "rope",
        "norm": "rmsnorm",
        # Llama may bias everything (attention_bias: Q, K, V and O; mlp_bias: the MLP); Qwen2 biases Q, K, V
        "linear_bias": r.flag("attention_bias") and r.flag("mlp_bias"),
        "qkv_bias": r.model_type == "qwen2" or r.flag("attention_bias"),
    }


def _first_moe_layer(start: int, is_moe: Callable[[int], bool], step: int) -> int:
    """Smallest layer index >= ``start`` that is MoE under a periodic rule of period ``step``."""
    return next(i for i in range(start, start + step) if is_moe(i))


def _mixtral(r: _Reader) -> dict[str, Any]:
    spec = _common(r)
    spec["moe"] = {
        "num_experts": r.integer("num_local_experts", "moe.num_experts"),
        "top_k": r.integer("num_experts_per_tok", "moe.top_k"),
        "expert_ffn_hidden_size": spec["ffn_hidden_size"],
    }
    r.origin["moe.expert_ffn_hidden_size"] = "intermediate_size"
    return spec


def _qwen3_moe(r: _Reader) -> dict[str, Any]:
    spec = _common(r) | {"qk_norm": True}
    step = r.integer("decoder_sparse_step", "moe.layer_frequency", default=1)
    dense = sorted(set(r.int_list("mlp_only_layers")))
    if dense != list(range(len(dense))):
        raise AutoparError(
            r.field("mlp_only_layers"),
            dense,
            "only leading dense layers are supported: list 0..k-1 (a prefix) or leave it empty",
            problem="has dense layers after MoE ones",
        )
    if step < 1:
        raise AutoparError(
            r.field("decoder_sparse_step"),
            step,
            "use 1 (every layer MoE) or a larger period",
            problem="must be a positive integer",
        )
    # transformers: layer i is MoE when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    first = _first_moe_layer(len(dense), lambda i: (i + 1) % step == 0, step)
    r.origin["moe.first_dense_layers"] = "mlp_only_layers"
    spec["moe"] = {
        "num_experts": r.integer("num_experts", "moe.num_experts"),
        "top_k": r.integer("num_experts_per_tok", "moe.top_k"),
        "expert_ffn_hidden_size": r.integer("moe_intermediate_size", "moe.expert_ffn_hidden_size"),
        "num_shared_experts": 0,
        "first_dense_layers": first,
        "layer_frequency": step,
    }
    return spec


def _deepseek_v3(r: _Reader) -> dict[str, Any]:
    spec = _common(r)
    k = r.integer("first_k_dense_replace", "moe.first_dense_layers", default=0)
    freq = r.integer("moe_layer_freq", "moe.layer_frequency", default=1)
    if freq < 1:
        raise AutoparError(
            r.field("moe_layer_freq"),
            freq,
            "use 1 (every layer MoE) or a larger period",
            problem="must be a positive integer",
        )
    if k < 0:
        raise AutoparError(
            r.field("first_k_dense_replace"),
            k,
            "use 0 or the number of leading dense layers",
            problem="must not be negative",
        )
    # DeepSeek modeling code: layer i is MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0.
    first = _first_moe_layer(k, lambda i: i % freq == 0, freq)
    spec["moe"] = None if first >= spec["num_layers"] else {  # no MoE layer: a dense MLA model
        "num_experts": r.integer("n_routed_experts", "moe.num_experts"),
        "top_k": r.integer("num_experts_per_tok", "moe.top_k"),
        "expert_ffn_hidden_size": r.integer("moe_intermediate_size", "moe.expert_ffn_hidden_size"),
        "num_shared_experts": r.integer("n_shared_experts", "moe.num_shared_experts", default=0),
        "first_dense_layers": first,
        "layer_frequency": freq,
    }
    spec["mla"] = {
        "q_lora_rank": r.integer("q_lora_rank", "mla.q_lora_rank", default=0),  # null: uncompressed queries
        "kv_lora_rank": r.integer("kv_lora_rank", "mla.kv_lora_rank"),
        "qk_nope_head_dim": r.integer("qk_nope_head_dim", "mla.qk_nope_head_dim"),
        "qk_rope_head_dim": r.integer("qk_rope_head_dim", "mla.qk_rope_head_dim"),
        "v_head_dim": r.integer("v_head_dim", "mla.v_head_dim"),
    }
    spec["head_dim"] = None  # MLA head sizes live in the mla section
    return spec


def _window(r: _Reader, every: int | None) -> dict[str, Any]:
    """A sliding window (``sliding_window``, null: none) on the blocks ``global_layer_every`` leaves windowed."""
    window = r.get("sliding_window", None)
    if window is None:
        return {}
    return {"sliding_window": r.integer("sliding_window", "sliding_window"), "global_layer_every": every}


def _gemma(r: _Reader) -> dict[str, Any]:
    """Gemma 2 (every second block global, logits soft-capped) and Gemma 3 (one block in
    ``sliding_window_pattern`` global, q/k norms): two extra norms per block."""
    spec = _common(r)
    gemma3 = r.model_type == "gemma3_text"
    every = r.integer("sliding_window_pattern", "global_layer_every", default=6) if gemma3 else 2
    cap = r.get("final_logit_softcapping", None)
    spec |= _window(r, every) | {"extra_norms": 2, "qk_norm": gemma3}
    if cap is not None:
        spec["logit_softcap"] = float(cap)
    return spec


def _qk_norm(r: _Reader) -> dict[str, Any]:
    """Qwen3 and OLMo 2: a norm on every query and key."""
    return _common(r) | {"qk_norm": True}


def _mistral(r: _Reader) -> dict[str, Any]:
    """Mistral: a sliding window on every block where the config sets one (7B v0.1: 4096)."""
    return _common(r) | _window(r, None)


_LAYOUTS: dict[str, Callable[[_Reader], dict[str, Any]]] = {
    **{t: _common for t in _DENSE},
    "mistral": _mistral,
    "qwen3": _qk_norm,
    "olmo2": _qk_norm,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
}


def _lookup(spec: dict[str, Any], path: str, default: object) -> object:
    """The value at a dotted ``path`` of the spec dict, else ``default``."""
    node: object = spec
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _invalid(err: ValidationError, r: _Reader, spec: dict[str, Any]) -> AutoparError:
    """Turn the first pydantic error into an AutoparError naming the config key behind it."""
    first = err.errors()[0]
    msg = str(first["msg"]).removeprefix("Value error, ")
    # Contract messages start with "field=value"; otherwise fall back to pydantic's location.
    named = re.match(r"([a-z_]+(?:\.[a-z_]+)?)=", msg)
    target = named.group(1) if named else ".".join(str(p) for p in first["loc"])
    key = r.origin.get(target, target)
    value: object = r.data[key] if key in r.data else _lookup(spec, target, first.get("input"))
    problem, _, fix = msg.partition("; ")
    return AutoparError(
        r.field(key) if key else r.source,
        value,
        fix or f"correct {key or 'the config'} in {r.source}",
        problem=f"gives an invalid model ({problem})",
    )


def model_spec_from_hf_config(config: dict | str | Path, name: str | None = None) -> ModelSpec:
    """A ``ModelSpec`` from a transformers ``config.json`` (a dict, the file's path or its folder).

    ``name`` defaults to the config's ``_name_or_path``, else its ``model_type``. Raises
    ``AutoparError`` naming the offending key for unreadable files, missing keys and invalid shapes,
    and ``UnknownNameError`` for a ``model_type`` outside ``SUPPORTED_MODEL_TYPES``.
    """
    data, source = _load(config)
    model_type = data.get("model_type")
    layout = _LAYOUTS.get(model_type) if isinstance(model_type, str) else None
    if layout is None:
        raise UnsupportedModelTypeError(model_type, list(SUPPORTED_MODEL_TYPES))
    reader = _Reader(data, source)
    spec = layout(reader)
    spec["name"] = name or str(data.get("_name_or_path") or model_type)
    try:
        return ModelSpec(**spec)
    except ValidationError as err:
        raise _invalid(err, reader, spec) from err
