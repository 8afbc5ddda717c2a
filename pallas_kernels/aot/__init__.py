"""The compile gate without a chip: ``python -m pallas_kernels.aot``.

Every kernel of ``ops.FAMILIES`` compiled for TPU (libtpu compile-only topologies) and for
sm_90 (Triton).
"""
