"""TPU (Pallas Mosaic) kernels: one module per op, same wrappers and contracts as ``gpu/``."""
