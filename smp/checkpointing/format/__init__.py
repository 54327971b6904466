"""What a checkpoint holds and how it is laid out: `smp_meta.json` and its checks (metadata.py),
packed tensor-parallel tensors written box by box (packed.py), a pipelined model's stages under
the whole model's names (pipeline.py), and each rank's RNG states (rng.py)."""
