"""Search for the fastest layout that fits: enumeration, bounds, CP-SAT for layer split and recompute."""

from planner.search.engine import SearchOptions, search

__all__ = ["SearchOptions", "search"]
