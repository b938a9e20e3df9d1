"""Laplace: train and serve Gated Linear Attention language models."""

__version__ = "0.1.0"
