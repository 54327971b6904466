"""Crashes, hangs, killed ranks and checkpoint commits under failure."""
