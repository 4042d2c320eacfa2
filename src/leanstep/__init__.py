"""leanstep: lean, robust JAX training steps."""
