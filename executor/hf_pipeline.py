"""Pipeline stages of a Hugging Face causal LM, each run by the model's own forward.

A Hugging Face decoder computes its masks (causal, sliding-window), rotary embeddings and model-level
scalars (Granite's embedding multiplier and logit scaling, Gemma's embedding scale and logit
soft-capping) in its outer forward, so a stage does not rewrite that forward: it runs it.

**Split** (:func:`split_hf_model`). Chunk ``c`` is a copy of the model holding only its layers, in a
:class:`KeptLayers` under their model-wide indices (``model.layers.7`` stays ``model.layers.7``, so
checkpoints do not depend on the plan), the embedding only on chunk 0, the final norm and LM head
only on the last chunk (``nn.Identity`` elsewhere). A config listing ``layer_types`` (Qwen2/3, Gemma:
which layers attend through a sliding window) gets the kept layers' entries, since those models index
it by position in the loop (the list keeps its length: the other layers' entries follow).

**Forward** (:func:`_stage_forward`). Chunk 0 takes token ids, the others the hidden states
``[B, S, D]`` of the chunk before. A later chunk calls the model's forward with zero ``inputs_embeds``
of the right shape (the masks and rotary tables depend only on it) and, for the duration of the call,
its first layer's entry is an :class:`_Inject` that hands that layer the received hidden states
instead. A chunk before the last returns what its last layer returned, caught by a :class:`_Catch`;
the last returns the logits. The stand-ins live only inside the call and hold the received tensor in
a local, so a recomputed layer (its checkpoint wrapper sits inside them) sees its own micro-batch's input.
Under sequence parallelism the hidden states between chunks are this rank's sequence shard, made
a ``Shard(1)`` DTensor again on arrival.
"""

from __future__ import annotations

import copy
import types

import torch
from torch import nn

from executor.adapters import HF, get_submodule


class KeptLayers(nn.ModuleDict):
    """The decoder layers one chunk keeps, keyed by their model-wide index; iterates, slices and
    indexes by position like the ``nn.ModuleList`` it replaces (``self.layers[:n]`` in a forward)."""

    def __getitem__(self, key: str | int | slice):  # noqa: ANN204 - a module or a list of them
        if isinstance(key, str):
            return super().__getitem__(key)
        return list(self.values())[key]

    def __iter__(self):  # noqa: ANN204 - an iterator of modules, as a ModuleList's
        return iter(list(self.values()))


class _Inject(nn.Module):
    """Calls ``layer`` with ``hidden`` in place of the hidden states it is given (the zeros the model's
    forward made from its dummy ``inputs_embeds``)."""

    def __init__(self, layer: nn.Module, hidden: torch.Tensor) -> None:
        super().__init__()
        object.__setattr__(self, "layer", layer)  # not a submodule: the tree keeps its names
        object.__setattr__(self, "hidden", hidden)

    def forward(self, _ignored, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        return self.layer(self.hidden, *args, **kwargs)


class _Catch(nn.Module):
    """Calls ``layer`` and keeps its output in ``box`` (the chunk's output: what follows is discarded)."""

    def __init__(self, layer: nn.Module, box: list) -> None:
        super().__init__()
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "box", box)

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        out = self.layer(*args, **kwargs)
        self.box.append(out)
        return out


def split_hf_model(model: nn.Module, ids: list[list[int]], chunks: list[int]) -> list[nn.Module]:
    """For each chunk index of ``chunks`` (this rank's), a deep copy of the Hugging Face ``model`` (build
    it on the meta device) holding the layers ``ids[c]`` as described in the module docstring."""
    last = len(ids) - 1
    forward = type(model).forward
    parts = []
    for c in chunks:
        part = copy.deepcopy(model)
        inner = part.get_submodule(HF.layers.rpartition(".")[0])
        layers = list(get_submodule(part, HF.layers))
        inner.layers = KeptLayers({str(i): layers[i] for i in ids[c]})
        types_ = getattr(part.config, "layer_types", None)
        if types_:  # the kept layers' types first (the config insists on one entry per model layer)
            part.config.layer_types = [types_[i] for i in ids[c]] + [t for i, t in enumerate(types_)
                                                                      if i not in ids[c]]
        if c != 0:
            inner.embed_tokens = None
        if c != last:
            inner.norm, part.lm_head = nn.Identity(), nn.Identity()
        part.autopar_stage = (c == 0, c == last, forward)
        part.forward = types.MethodType(_stage_forward, part)
        parts.append(part)
    return parts


def _stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Token ids (chunk 0) or hidden states -> logits (last chunk) or hidden states."""
    first, last, forward = self.autopar_stage
    layers = get_submodule(self, HF.layers)
    names = list(layers.keys())
    box: list = []
    saved = {names[0]: layers[names[0]], names[-1]: layers[names[-1]]}
    try:
        kwargs = _position_kwargs(self, x)
        if first:
            kwargs["input_ids"] = x
        else:
            kwargs["inputs_embeds"] = _zeros_like_stream(self, x)
            layers._modules[names[0]] = _Inject(saved[names[0]], _arrive(self, x))
        if not last:
            layers._modules[names[-1]] = _Catch(layers._modules[names[-1]], box)
        out = forward(self, **kwargs)
    finally:
        layers._modules.update(saved)
    return out.logits if last else _leave(box[-1])


def _position_kwargs(part: nn.Module, x: torch.Tensor) -> dict:
    """The rank's global ``position_ids`` under context parallelism (:func:`executor.hf_cp.set_positions`)."""
    ids = getattr(part, "autopar_position_ids", None)
    return {} if ids is None else {"position_ids": ids.to(x.device)}


def _sp_mesh(part: nn.Module):  # noqa: ANN202 - a DeviceMesh or None
    return getattr(part, "autopar_sp_mesh", None)


def _arrive(part: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The received hidden states as the layers take them: a ``Shard(1)`` DTensor under SP."""
    mesh = _sp_mesh(part)
    if mesh is None:
        return x
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False)


def _leave(out: torch.Tensor | tuple) -> torch.Tensor:
    """A layer's output as a plain tensor to send (its local shard under SP)."""
    out = out[0] if isinstance(out, tuple) else out
    return out.to_local() if hasattr(out, "to_local") else out


def _zeros_like_stream(part: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Dummy ``inputs_embeds`` of the whole sequence for the received ``x`` (this rank's sequence shard
    under SP): the masks and rotary tables are made from its shape."""
    mesh = _sp_mesh(part)
    b, s = x.shape[0], x.shape[1] * (mesh.size() if mesh is not None else 1)
    return torch.zeros(b, s, x.shape[-1], dtype=x.dtype, device=x.device)


def is_hf_stage(part: nn.Module) -> bool:
    return hasattr(part, "autopar_stage")

