"""The one place the version of smp_collectives is written (both pyprojects read it)."""

__version__ = "0.1.0"
