"""Shared test configuration.

System tools and optional extras: ``tests/needs.py`` (skip when absent, fail under
``CALEXEC_REQUIRE_TOOLS=1``); the ``requires_tool(name, ...)`` marker is checked here before a
test's fixtures are set up.

hypothesis: the ``ci`` profile (derandomised, no deadline, printed reproduction blob) is loaded
when the ``CI`` environment variable is set, as ``.ci/run`` does; locally the ``dev`` profile.
``calexec charts mutate`` picks ``mutate`` (``--hypothesis-profile=mutate``): derandomised, no
example database, no shrinking (a mutant only needs a failure, not the smallest one).
"""

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

import needs

pytest_plugins = ["driver_fixtures"]

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "mutate",
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# Lock-rank checking on in every test (issue 13): each executor, KV coordinator and pool built
# during a test checks the §5.2 order (machines/locks.py), and no test may end with a violation.
os.environ.setdefault("CALEXEC_CHECK_LOCK_ORDER", "1")


@pytest.fixture(autouse=True)
def _no_lock_order_violations():
    from calexec.machines.locks import ALL_ORDERS

    before = {id(order): len(order.violations) for order in list(ALL_ORDERS)}
    yield
    new = [v for order in list(ALL_ORDERS)
           for v in order.violations[before.get(id(order), 0):]]
    assert not new, f"lock order violations: {new[:3]}"


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_tool(*names): the test runs system tools "
                            "(skipped when absent; failed under CALEXEC_REQUIRE_TOOLS=1)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for marker in item.iter_markers("requires_tool"):
        for name in marker.args:
            needs.tool(name)
