"""Plain-jnp references of every op (the kernels' exactness oracle) and shared shape checks."""
