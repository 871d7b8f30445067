"""rotary.attention."""
