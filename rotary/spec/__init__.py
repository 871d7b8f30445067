"""rotary.spec."""
