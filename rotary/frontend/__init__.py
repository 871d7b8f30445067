"""rotary.frontend."""
