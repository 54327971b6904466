"""Rank-side runs of tests/smp_v2_script/train.py for tests/test_smp_v2_script.py."""

from __future__ import annotations

import os


def run(*, mp_parameters: str, argv: list[str]) -> dict:
    os.environ["SM_HP_MP_PARAMETERS"] = mp_parameters
    try:
        from tests.smp_v2_script import train

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
