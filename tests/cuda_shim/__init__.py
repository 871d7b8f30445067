"""Host shim that runs the CUDA kernel sources on the CPU (test harness, not a backend)."""
