"""smp_collectives: gradient-synchronisation collectives for FSDP2, usable without smp."""

__version__ = "0.1.0"
