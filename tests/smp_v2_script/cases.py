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
