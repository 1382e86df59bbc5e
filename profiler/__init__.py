"""autopar profiler (see DESIGN.md)."""
