"""Sharded checkpoints, trust checks, Checkpointer, HF load/export memory."""
