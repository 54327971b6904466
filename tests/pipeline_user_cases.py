"""Rank-side cases for tests/test_pipeline_user.py: what a training script sees under pipeline
parallelism (smp.state's pipeline coordinates). Each returns plain data."""

from __future__ import annotations

import smp


def state_coordinates(config: dict) -> dict:
    """smp.state's pipeline and data-parallel coordinates on this rank."""
    with smp.session(config):
        st = smp.state
        return {"rank": st.rank, "pp_rank": st.pp_rank, "pp_size": st.pp_size, "dp_rank": st.dp_rank,
                "dp_size": st.dp_size}
