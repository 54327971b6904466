"""smp.step, packed rows, activation checkpointing and offloading, compile, FP8."""
