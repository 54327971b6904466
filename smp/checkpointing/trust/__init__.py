"""A checkpoint folder is untrusted input: file digests (digest.py) taken from the bytes DCP
writes and reads (inline_digest.py), pickles read through allow-lists (safe_read.py), and the
checks a load runs before anything reaches the model (verify.py)."""
