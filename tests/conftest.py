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
import signal

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

# A run started as a background job of a non-interactive shell (``bash .ci/run &``, ``nohup
# ... &``: bash ignores SIGINT and SIGQUIT for it) inherits SIGINT ignored, and Python then
# installs no KeyboardInterrupt handler: a test raising SIGINT in its own process (a Ctrl-C
# landing inside Popen()) waited for nothing, its command's whole timeout. Every process of the
# run (pytest-xdist's workers import this file too) takes Ctrl-C as an interactive one does.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Lock-rank checking on in every test (issue 13): each executor, KV coordinator and pool built
# during a test checks the §5.2 order (machines/locks.py), and no test may end with a violation.
os.environ.setdefault("CALEXEC_CHECK_LOCK_ORDER", "1")


@pytest.fixture(autouse=True, scope="session")
def _explorer_replay_files_in_the_sessions_directory(tmp_path_factory):
    """The failures the explorer's tests expect each write a replay file
    (``CALEXEC_EXPLORE_REPLAY_DIR``, docs/testing.md): into this session's temporary directory,
    not /tmp, where every run of the suite left a few more behind (test commands run in a
    subprocess inherit it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CALEXEC_EXPLORE_REPLAY_DIR", str(tmp_path_factory.mktemp("explore-replays")))
        yield


@pytest.fixture(autouse=True)
def _no_lock_order_violations():
    from calexec.machines.locks import ALL_ORDERS

    before = {id(order): len(order.violations) for order in list(ALL_ORDERS)}
    yield
    new = [v for order in list(ALL_ORDERS)
           for v in order.violations[before.get(id(order), 0):]]
    assert not new, f"lock order violations: {new[:3]}"


# Chart contracts on in every test (issue 26): the invariants machines/charts.py declares per
# state (machines/chart_contracts.py) are checked by every compiled and python-statemachine run
# of calexec's charts; a violation raises from the send that broke it, and one swallowed on an
# executor thread still fails the test that caused it.
_CONTRACTS = None


@pytest.fixture(autouse=True)
def _no_contract_violations(request):
    before = len(_CONTRACTS.violations) if _CONTRACTS is not None else 0
    yield
    if _CONTRACTS is not None and not request.node.get_closest_marker(
            "contract_violations_expected"):
        new = _CONTRACTS.violations[before:]
        assert not new, f"chart contract violations: {[str(v) for v in new[:3]]}"


def pytest_configure(config):
    config.addinivalue_line("markers", "contract_violations_expected: the test breaks a "
                            "chart contract on purpose (tests/test_chart_contracts.py)")
    global _CONTRACTS
    from calexec.machines.chart_contracts import enable_contracts
    from calexec.machines.charts import DECLARED

    if _CONTRACTS is None:
        _CONTRACTS = enable_contracts(*DECLARED.values())
    config.addinivalue_line("markers", "requires_tool(*names): the test runs system tools "
                            "(skipped when absent; failed under CALEXEC_REQUIRE_TOOLS=1)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for marker in item.iter_markers("requires_tool"):
        for name in marker.args:
            needs.tool(name)
