"""Compile gate without a chip: every kernel of ``ops.FAMILIES`` compiled for TPU (libtpu
compile-only topologies) and for sm_90 (Triton), ``python -m pallas_kernels.aot``."""
