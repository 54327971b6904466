"""Causal LMs by name: smp's catalogue of model shapes, local transformers configs, and building
a randomly initialised model from either (the example, `smp plan` and the benchmarks use them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

# Named model shapes (transformers Llama configs: no download, built from numbers).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # CPU demo / tests: 2 layers of width 64, byte-level vocabulary.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=2048),
    # Llama 3.2 1B shape (tied embeddings).
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, head_dim=64, tie_word_embeddings=True,
                     max_position_embeddings=131072, rope_theta=500000.0),
    # Llama 3.1 8B shape.
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                     rope_theta=500000.0),
    # Llama 3.1 70B shape.
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                      rope_theta=500000.0),
}


class ModelSpecError(ValueError):
    """A --model that names no known shape and no usable local folder."""


def resolve_model_config(spec: str, **overrides: Any):
    """A transformers config from a named shape (`MODEL_SHAPES`), a local model folder holding
    config.json, or a config.json file. Never touches the network."""
    from transformers import AutoConfig, LlamaConfig

    if spec in MODEL_SHAPES:
        return LlamaConfig(**{**MODEL_SHAPES[spec], **overrides})
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelSpecError(
                f"model folder {spec!r} has no config.json; point --model at a folder saved with "
                f"save_pretrained (config.json + weights), or use a named shape: {', '.join(MODEL_SHAPES)}"
            )
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    elif path.is_file() and path.suffix == ".json":
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ModelSpecError(f"{spec!r} has no 'model_type' key; is it a transformers config.json?")
        config = AutoConfig.for_model(**data)
    else:
        raise ModelSpecError(
            f"--model {spec!r} is neither a named shape ({', '.join(MODEL_SHAPES)}) nor an existing "
            f"local folder with a config.json"
        )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def build_causal_lm(config) -> nn.Module:
    """A randomly initialised causal LM of the config's architecture (in the current device context)."""
    from transformers import AutoModelForCausalLM

    # sdpa: the fused attention a real run uses (and the one `smp plan` models when counting
    # activations: smp/planning/activations.py).
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
