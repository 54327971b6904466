"""The one place the version of smp is written (pyproject reads it; `smp --version` prints it)."""

__version__ = "0.1.0"
