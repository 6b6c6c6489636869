"""Causal depthwise short convolution (+ SiLU) with a carried tail; `short_conv` is the same op."""

from .naive import causal_conv1d

short_conv = causal_conv1d

__all__ = ["causal_conv1d", "short_conv"]
