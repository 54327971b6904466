"""smp's exceptions: one base, `smp.Error`, so `except smp.Error` catches every error smp raises
on purpose, each with a message that says what is wrong and how to fix it.

Each kind also subclasses the builtin it refines (a bad value is a ValueError, a failed peer a
RuntimeError), so code written against the builtins keeps working. `NonFiniteGradientError`
lives with the check that builds it (smp/reliability/finite.py). This module imports nothing
of smp's: every other module can import it.
"""

from __future__ import annotations


class Error(Exception):
    """Base class of the errors smp raises on purpose."""


class ConfigError(Error, ValueError):
    """A configuration value smp cannot use. The message names the key and the fix."""


class CheckpointError(Error):
    """A checkpoint smp cannot use with this model: the message says what differs and why."""


class PlanError(Error, ValueError):
    """A tensor-parallel plan that cannot be applied to this model as written (its styles
    contradict each other), whatever the configuration says."""


class UsageError(Error, ValueError):
    """A mistake on the `smp` command line; the command exits with status 2, as argparse does."""


class PeerFailure(Error, RuntimeError):
    """Raised on a rank whose step failed because another rank failed first."""


class UnsupportedVersionError(Error, RuntimeError):
    """A feature the installed torch / transformers / accelerate cannot provide. Raised when the
    feature is used (never at `import smp`); the message names the feature, the installed
    version and the version it needs."""


class SMPWarning(UserWarning):
    """Base class of the warnings smp gives on purpose. Every smp warning is one, so a job or a
    test suite can turn them all into errors (`-W error::smp.errors.SMPWarning`)."""
