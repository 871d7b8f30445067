"""rotary.cli."""
