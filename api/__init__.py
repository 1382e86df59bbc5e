"""autopar api (see DESIGN.md)."""
