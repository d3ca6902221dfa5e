"""Suite-wide settings. The CPU tests run k3-tiny-sized ops, where intra-op threads cost far more than
they give on a 2-core machine (10x slower seen with two threads under load): one thread."""

import torch

torch.set_num_threads(1)


import os  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402


def pytest_runtest_setup(item):
    """Every test marked ``gpu`` needs an sm_90 device; elsewhere it is skipped with the reason."""
    if item.get_closest_marker("gpu") is not None:
        from k3_fastpath._lib import arch

        reason = arch.sm90_unsupported_reason()
        if reason:
            pytest.skip(reason=reason)


@pytest.fixture
def seed():
    """A fresh seed per test (torch and random), reported in failure messages so a failure can be replayed:
    ``K3_TEST_SEED=<seed>`` gives every test that seed."""
    s = int(os.environ["K3_TEST_SEED"]) if os.environ.get("K3_TEST_SEED") else random.randrange(2**31)
    torch.manual_seed(s)
    random.seed(s)
    return s
