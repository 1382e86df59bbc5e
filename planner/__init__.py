"""autopar planner: contracts, cost model and search. Pure Python + OR-Tools; never imports torch."""

__version__ = "0.1.0"
