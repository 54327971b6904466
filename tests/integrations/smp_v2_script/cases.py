"""Rank-side runs of tests/integrations/smp_v2_script/train.py for tests/integrations/test_smp_v2_script.py."""

from __future__ import annotations

import os


def run(*, mp_parameters: str, argv: list[str]) -> dict:
    os.environ["SM_HP_MP_PARAMETERS"] = mp_parameters
    try:
        from tests.integrations.smp_v2_script import train

        return train.main(argv)
    finally:
        os.environ.pop("SM_HP_MP_PARAMETERS", None)


def refusal(*, mp_parameters: str, argv: list[str]) -> str:
    """The smp error a run raises on this rank (the run must raise one)."""
    from smp.errors import Error

    try:
        run(mp_parameters=mp_parameters, argv=argv)
    except Error as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("the run was not refused")


def refusal_without_loader_group(*, mp_parameters: str, argv: list[str]) -> str:
    """The run with smp.sagemaker's group for torch's sharded optimizer loader switched off (the
    negative control of that patch): torch cuts the optimizer state over the whole world."""
    from smp.sagemaker import fsdp1

    found = fsdp1._slice_group
    fsdp1._slice_group = lambda model_state_dict: None  # read when tsm.init installs the patch
    try:
        return refusal(mp_parameters=mp_parameters, argv=argv)
    finally:
        fsdp1._slice_group = found
