"""smp plan: memory, communication and layout search."""
