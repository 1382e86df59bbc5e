"""autopar executor (see DESIGN.md)."""
