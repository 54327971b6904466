"""FSDP2 units and layouts, gradient sync and parameter gather through smp's collectives."""
