"""rotary.interop."""
