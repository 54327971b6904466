"""Test utilities shipped with smp: a reusable pool of gloo ranks (and `free_port` for ranks
started by hand), tiny reference models, and (D)Tensor helpers for comparing runs."""

from smp.testing.rank_pool import free_port

__all__ = ["free_port"]
