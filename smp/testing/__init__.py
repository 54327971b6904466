"""Test utilities shipped with smp: a reusable pool of gloo ranks and tiny reference models."""
