"""The lab's tests that build namespaces need root, `ip`, `tc` and `iptables`; elsewhere they skip."""

import pytest

from swarm.testing import missing_requirements


@pytest.fixture
def needs_lab() -> None:
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
