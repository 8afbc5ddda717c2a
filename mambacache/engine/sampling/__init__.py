"""Sampling: per-request parameters, the jitted sampler, logit controls."""
