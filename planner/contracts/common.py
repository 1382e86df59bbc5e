"""Shared pieces of the contracts: the schema version, the strict base model and enums."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

SCHEMA_VERSION = "1"


class Contract(BaseModel):
    """Base of every contract: unknown fields are an error, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


MAX_NAME_CHARS = 200  # pages and tables show a name whole
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)  # no profile or run of this field predates it
FUTURE_SLACK = timedelta(days=1)  # clocks disagree; a date further ahead is a typo (the year 9999)
MAX_STEP_S = 7 * 86400.0  # a training step that takes a week is a unit mistake, not a measurement


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("is blank; give a name (pages, tables and the service's lists show it)")
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"is {len(value):,} characters long; give at most {MAX_NAME_CHARS} (pages and tables show "
                         "it whole)")
    return value


Name = Annotated[str, AfterValidator(_not_blank)]
"""A model's, cluster's or device's name: any text but an empty or blank one, at most 200 characters."""


def _url_safe(value: str) -> str:
    bad = sorted({c for c in value if c in "/\\?#%" or ord(c) < 32 or ord(c) == 127})
    if bad:
        raise ValueError(f"holds {', '.join(repr(c) for c in bad)}: a cluster's name is part of its address "
                         "(/v1/clusters/{name}/profiles); use letters, digits, spaces and - _ . : ( ) +")
    return value


ClusterName = Annotated[str, AfterValidator(_not_blank), AfterValidator(_url_safe)]
"""A cluster's name: a :data:`Name` that can stand in a URL path segment (no / \\ ? # % or control characters)."""


def plausible_date(value: datetime) -> datetime:
    """A timestamp between 2000 and tomorrow (UTC; naive ones read as UTC), else ValueError naming it."""
    aware = value if value.tzinfo else value.replace(tzinfo=UTC)
    if not EARLIEST <= aware <= datetime.now(UTC) + FUTURE_SLACK:
        raise ValueError(f"is {value.isoformat()}: give a time between {EARLIEST.date()} and now (UTC); a profile "
                         "or run is stamped when it was measured")
    return value


PlausibleDate = Annotated[datetime, AfterValidator(plausible_date)]


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
