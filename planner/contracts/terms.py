"""The terms a training step's time is split into: measured (``RunReport.breakdown``, ``executor/measure.py``),
predicted (``Prediction.terms``) and calibrated (``ClusterProfile.calibration``) in one vocabulary for the
executor, the planner and the pages."""

from __future__ import annotations

from collections.abc import Iterable

COMPUTE_TERMS = ("gemm", "attention", "elementwise", "loss")
COMM_TERMS = ("tp", "cp", "ep", "pp", "dp_grad", "dp_param")
STEP_TERMS = (*COMPUTE_TERMS, *COMM_TERMS, "optimizer", "other")
TERM_MEANING = {
    "gemm": "matrix multiplications (linear layers, grouped expert GEMMs)",
    "attention": "the attention core (scaled dot-product, its backward)",
    "elementwise": "memory-bound operators: norms, activations, rotary embedding, residuals, embedding lookup",
    "loss": "the cross-entropy over the vocabulary",
    "tp": "tensor/sequence-parallel collectives", "cp": "context-parallel collectives",
    "ep": "expert-parallel dispatch and combine", "pp": "pipeline sends and receives, waiting for the neighbour "
    "stage included (the bubble)", "dp_grad": "gradient reduction", "dp_param": "weight gathers (ZeRO-3/FSDP)",
    "optimizer": "the optimizer step", "other": "the rest of the step: framework overhead, unattributed waits",
}


def unknown_terms(names: Iterable[str]) -> None:
    """Raise ValueError (a pydantic validator's error) naming any of ``names`` that is not a term."""
    unknown = sorted(set(names) - set(STEP_TERMS))
    if unknown:
        raise ValueError(f"unknown terms {unknown}: use {', '.join(STEP_TERMS)}")
