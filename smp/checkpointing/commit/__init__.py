"""How a save becomes a checkpoint: the atomic commit and what `latest` and `keep_last` may see
and delete (atomic.py), which run a checkpoint belongs to (run.py), background saves
(async_save.py), every rank naming one path (same_path.py), and what a failed write reports
(save_errors.py)."""
