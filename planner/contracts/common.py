"""Shared pieces of the contracts: the schema version, the strict base model and enums."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

SCHEMA_VERSION = "1"


class Contract(BaseModel):
    """Base of every contract: unknown fields are an error, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("is blank; give a name (pages, tables and the service's lists show it)")
    return value


Name = Annotated[str, AfterValidator(_not_blank)]
"""A model's, cluster's or device's name: any text but an empty or blank one."""


class Precision(str, Enum):
    """Numeric format of the matmuls (and the activations they produce)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp8 = "fp8"

    @property
    def bytes(self) -> int:
        """Bytes per activation / low-precision weight element.

        FP8 training keeps weights and activations between ops in bf16 and casts inside the
        matmul (Transformer Engine, torchao float8), so it stores 2 bytes like bf16.
        """
        return 4 if self is Precision.fp32 else 2


class Optimizer(str, Enum):
    adam = "adam"
    adamw = "adamw"
    sgd = "sgd"

    @property
    def state_bytes_per_param(self) -> int:
        """fp32 optimizer state per parameter: Adam/AdamW keep m and v (2 x 4 bytes), SGD momentum 4."""
        return 8 if self in (Optimizer.adam, Optimizer.adamw) else 4
