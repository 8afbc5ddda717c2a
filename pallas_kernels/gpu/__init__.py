"""GPU (Pallas Triton backend) kernels: same wrappers and contracts as the TPU ones."""
