"""Adapters for other array libraries: torch (autograd functions, CUDA tensors through CuPy), JAX
(``jax.pure_callback`` / pure ``jnp`` under jit), Dask (block mapping) and ml_dtypes bfloat16. Each
imports its library only when an array of it arrives (``rotary.frontend.dispatch``) and calls the same
frontend and backend primitives."""
