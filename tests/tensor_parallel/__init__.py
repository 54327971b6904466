"""Tensor and sequence parallel plans, rules, vocabulary, LoRA under TP."""
