"""Where the parts of a decoder live, for the built-in model and Hugging Face models alike.

Tensor- and pipeline-parallel code asks a :class:`ModelAdapter` for module paths (dotted, relative
to the model or to one decoder layer) instead of hard-coding ``attention.wq`` or
``self_attn.q_proj``, so the same code shards both model families.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from torch import nn


@dataclass(frozen=True)
class ModelAdapter:
    """Module paths of one model family.

    Model-level paths (``embedding``, ``layers``, ``final_norm``, ``lm_head``, ``rotary``) are relative
    to the model; the others are relative to one decoder layer. ``mlp`` names the dense feed-forward
    module and ``moe`` the Mixture-of-Experts block of an MoE layer (the built-in model uses
    different attribute names for the two, Hugging Face models use ``mlp`` for both; see
    :meth:`ffn_of`). ``lm_head`` is None when the head shares the embedding's weight and no separate
    module exists. ``rotary`` names a shared rotary-embedding module (Hugging Face) or is None.
    """

    family: str
    embedding: str
    layers: str
    final_norm: str
    lm_head: str | None
    rotary: str | None
    attention_norm: str
    attention: str
    q_proj: str
    k_proj: str
    v_proj: str
    o_proj: str
    ffn_norm: str
    mlp: str
    gate_proj: str
    up_proj: str | None
    down_proj: str
    moe: str

    def layer_items(self, model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        """(name, decoder layer) in order; names are the keys of the layer container."""
        container = get_submodule(model, self.layers)
        if isinstance(container, nn.ModuleDict):
            yield from container.items()
        else:
            yield from container.named_children()

    def is_moe(self, layer: nn.Module) -> bool:
        """True when ``layer``'s feed-forward is a Mixture-of-Experts block (it holds ``experts``)."""
        return hasattr(self.ffn_of(layer), "experts")

    def ffn_of(self, layer: nn.Module) -> nn.Module:
        """The layer's feed-forward module: the dense MLP or the MoE block."""
        if hasattr(layer, self.mlp):
            return getattr(layer, self.mlp)
        return get_submodule(layer, self.moe)

    def attention_of(self, layer: nn.Module) -> nn.Module:
        return get_submodule(layer, self.attention)


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    """``root.get_submodule(path)`` with an error naming the missing step."""
    module = root
    for part in path.split("."):
        if not hasattr(module, part) or getattr(module, part) is None:
            raise AttributeError(f"{type(root).__name__} has no module {path!r} (missing {part!r})")
        module = getattr(module, part)
    return module


BUILTIN = ModelAdapter(
    family="builtin", embedding="tok_embeddings", layers="layers", final_norm="norm", lm_head="output",
    rotary=None, attention_norm="attention_norm", attention="attention", q_proj="wq", k_proj="wk",
    v_proj="wv", o_proj="wo", ffn_norm="ffn_norm", mlp="feed_forward", gate_proj="w1", up_proj="w3",
    down_proj="w2", moe="moe",
)

HF = ModelAdapter(
    family="hf", embedding="model.embed_tokens", layers="model.layers", final_norm="model.norm",
    lm_head="lm_head", rotary="model.rotary_emb", attention_norm="input_layernorm", attention="self_attn",
    q_proj="q_proj", k_proj="k_proj", v_proj="v_proj", o_proj="o_proj", ffn_norm="post_attention_layernorm",
    mlp="mlp", gate_proj="gate_proj", up_proj="up_proj", down_proj="down_proj", moe="mlp",
)


def builtin_adapter(model: nn.Module) -> ModelAdapter:
    """The adapter of an :class:`executor.model.Transformer`: ``lm_head`` None when the embedding is
    tied, ``up_proj`` None for a GeLU MLP (w1, w2 only)."""
    spec = model.spec
    return replace(BUILTIN, lm_head=None if spec.tied_embeddings else BUILTIN.lm_head,
                   up_proj=BUILTIN.up_proj if spec.ffn_kind == "swiglu" else None)


def norm_width(attention: nn.Module, module: nn.Module, a: ModelAdapter) -> str | None:
    """How a weighted module inside ``attention`` (other than its projections) sees the heads, told by
    its weight's length: ``"head"`` when it equals ``attention.head_dim`` (a per-head norm: Qwen3,
    Gemma 3), ``"row"`` when it equals the output width of the q or k projection (a norm over the whole
    projection: OLMo 2), None when neither (the module cannot be placed under tensor parallelism)."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 1 or len(list(module.parameters())) != 1:
        return None
    width = weight.shape[0]
    if width == getattr(attention, "head_dim", None):
        return "head"
    projections = (getattr(attention, p, None) for p in (a.q_proj, a.k_proj))
    outs = {m.out_features for m in projections if isinstance(m, nn.Linear)}
    return "row" if width in outs else None



def is_mla(attention: nn.Module) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come up from a latent through ``kv_b_proj``."""
    return isinstance(getattr(attention, "kv_b_proj", None), nn.Linear)
