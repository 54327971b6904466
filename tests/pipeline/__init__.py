"""Pipeline stages, schedules, ties, compositions and their checkpoints."""
