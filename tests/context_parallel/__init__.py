"""Context parallel attention (ring, all-gather, Ulysses) and the batch cut."""
