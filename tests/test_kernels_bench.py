"""pallas_kernels.bench bookkeeping: device recognition and the chunked-prefill FLOP count."""

from __future__ import annotations

from pallas_kernels.bench import ROOFLINES, gdr_chunked_flops, roofline, ssd_chunked_flops


def test_roofline_tells_v5p_from_v5e_and_finds_gpus():
    assert roofline("TPU v5") == ROOFLINES["TPU v5p"]          # v5p's device_kind
    assert roofline("TPU v5 lite") == ROOFLINES["TPU v5e"]
    assert roofline("TPU v5 lite")[0] == 819e9 and roofline("TPU v5")[0] == 2765e9
    assert roofline("NVIDIA H200")[1]["tf32"] == 494e12
    assert roofline("TPU v7x") is None and roofline("cpu") is None


def test_chunked_flops_exceed_the_token_recurrence_count():
    t, b, hv, d = 4096, 8, 32, 128
    ratio = gdr_chunked_flops(t, b, hv, d, d) / (6 * t * hv * d * d)
    assert 1.5 < ratio < 2.5
    # one more padding chunk per extra sequence
    assert gdr_chunked_flops(t, b + 1, hv, d, d) > gdr_chunked_flops(t, b, hv, d, d)


def test_ssd_chunked_flops_exceed_the_token_recurrence_count():
    """Nemotron-H's mixer (128 heads of 64, state 128, 8 groups): the chunked form does more
    than the 6 N P FLOPs a token and head of the recurrence (the intra-chunk scores)."""
    t, b, h, g, n, p = 4096, 8, 128, 8, 128, 64
    ratio = ssd_chunked_flops(t, b, h, g, n, p) / (6 * t * h * n * p)
    assert 1.0 < ratio < 2.0
    assert ssd_chunked_flops(t, b + 1, h, g, n, p) > ssd_chunked_flops(t, b, h, g, n, p)
