"""Search for the fastest layout that fits: enumeration, bounds, CP-SAT for layer split and recompute."""

from planner.search.options import SearchOptions

__all__ = ["SearchOptions", "search"]


def __getattr__(name: str):  # noqa: ANN202 - the engine (and OR-Tools) load on first use of ``search``
    if name == "search":
        from planner.search.engine import search

        return search
    raise AttributeError(f"module 'planner.search' has no attribute {name!r}")
