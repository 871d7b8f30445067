"""rotary.conformance."""
