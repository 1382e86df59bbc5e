"""TrainingConfig: what one optimizer step processes, in which numeric format, with which optimizer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from planner.contracts.common import SCHEMA_VERSION, Contract, Optimizer, Precision
from planner.contracts.limits import MAX_GLOBAL_BATCH, MAX_GLOBAL_BATCH_TOKENS, MAX_SEQ


class TrainingConfig(Contract):
    """Global batch (in sequences or in tokens), sequence length, precision and optimizer."""

    schema_version: Literal["1"] = SCHEMA_VERSION
    seq_length: int = Field(gt=0, le=MAX_SEQ, strict=True)
    global_batch_size: int | None = Field(None, gt=0, le=MAX_GLOBAL_BATCH, strict=True,
                                          description="sequences per optimizer step")
    global_batch_tokens: int | None = Field(None, gt=0, le=MAX_GLOBAL_BATCH_TOKENS, strict=True,
                                            description="tokens per optimizer step")
    precision: Precision = Precision.bf16
    optimizer: Optimizer = Optimizer.adamw
    master_weights_fp32: bool = Field(True, description="keep an fp32 copy of the weights (mixed precision)")
    grad_reduce_in_fp32: bool = Field(True, description="accumulate and reduce gradients in fp32")
    moe_load_imbalance: float = Field(
        1.0, ge=1.0, le=64.0, strict=True,
        description="routed tokens on the busiest expert rank relative to a perfect balance (it sets the pace)",
    )
    flash_attention: bool = Field(
        True, description="fused attention that never stores the s x s scores (False: Megatron-2021-style unfused)"
    )

    @model_validator(mode="after")
    def _batch(self) -> TrainingConfig:
        if (self.global_batch_size is None) == (self.global_batch_tokens is None):
            raise ValueError(
                "give exactly one of global_batch_size (sequences) or global_batch_tokens; got "
                f"global_batch_size={self.global_batch_size}, global_batch_tokens={self.global_batch_tokens}"
            )
        if self.global_batch_tokens is not None and self.global_batch_tokens % self.seq_length:
            raise ValueError(
                f"global_batch_tokens={self.global_batch_tokens} is not a multiple of seq_length="
                f"{self.seq_length}; use "
                f"{self.global_batch_tokens // self.seq_length * self.seq_length or self.seq_length}"
            )
        if self.global_batch_seqs > MAX_GLOBAL_BATCH:
            raise ValueError(
                f"global_batch_tokens={self.global_batch_tokens} is {self.global_batch_seqs:,} sequences of "
                f"seq_length={self.seq_length}, more than {MAX_GLOBAL_BATCH:,} (no training run uses as many); "
                "check the units, or give longer sequences"
            )
        if self.precision is Precision.fp32:
            # no low-precision copy exists to keep a master copy of
            object.__setattr__(self, "master_weights_fp32", False)
        return self

    @property
    def global_batch_seqs(self) -> int:
        if self.global_batch_size is not None:
            return self.global_batch_size
        assert self.global_batch_tokens is not None
        return self.global_batch_tokens // self.seq_length

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_seqs * self.seq_length
