"""Devices for the afdep tests: every test taking `device` runs on the CPU (afdep's oracle)
and on CUDA (afdep's GPU layer). Without a GPU the CUDA variants skip with the reason; with
AFDEP_REQUIRE_GPU=1 they fail instead."""

import os

import pytest
import torch


def cuda_or_skip() -> None:
    """Skips (or, with AFDEP_REQUIRE_GPU=1, fails) when torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    why = f"no CUDA device visible to torch {torch.__version__}"
    if os.environ.get("AFDEP_REQUIRE_GPU") == "1":
        pytest.fail(f"AFDEP_REQUIRE_GPU=1 but {why}")
    pytest.skip(f"SKIP: {why}")


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    if request.param == "cuda":
        cuda_or_skip()
    return request.param
