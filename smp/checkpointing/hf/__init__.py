"""Hugging Face interop: a consolidated safetensors export (export.py, into a folder holding
other files: folder.py; integer and bool tensors: nonfloat.py) and a streaming import that reads
what `from_pretrained` reads (load.py; which files and headers: checks.py; byte-range reads:
read.py; transformers' converters: conversion.py; tied names: ties.py)."""

from smp.checkpointing.hf.export import DEFAULT_MAX_SHARD_BYTES, export_hf
from smp.checkpointing.hf.load import eager_load_note, load_hf

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "eager_load_note", "export_hf", "load_hf"]
