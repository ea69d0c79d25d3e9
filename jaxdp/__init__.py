"""jaxdp: Megatron-Core data parallelism for JAX."""
