"""A per-profile memo for the duration of one search.

The search prices thousands of layouts of one cluster profile; they share a few thousand GEMM
shapes and a handful of (link level, collective, group size) lookups. ``memoised(profile)`` keeps
those results for a block. It is scoped (a context variable, so per thread) rather than global: a
profile is a mutable model, and only a caller that holds it unchanged for the block may reuse them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from planner.contracts import ClusterProfile

_MEMO: ContextVar[tuple[ClusterProfile, dict] | None] = ContextVar("autopar_profile_memo", default=None)


@contextmanager
def memoised(profile: ClusterProfile) -> Iterator[None]:
    token = _MEMO.set((profile, {}))
    try:
        yield
    finally:
        _MEMO.reset(token)


def memo_for(profile: ClusterProfile) -> dict | None:
    """The active memo if ``profile`` is the profile it was opened for, else None."""
    active = _MEMO.get()
    return active[1] if active is not None and active[0] is profile else None
