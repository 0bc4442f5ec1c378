"""Shared test configuration.

hypothesis: the ``ci`` profile (derandomised, no deadline, printed reproduction blob) is loaded
when the ``CI`` environment variable is set, as ``.ci/run`` does; locally the ``dev`` profile.
``calexec charts mutate`` picks ``mutate`` (``--hypothesis-profile=mutate``): derandomised, no
example database, no shrinking (a mutant only needs a failure, not the smallest one).
"""

import os

from hypothesis import HealthCheck, Phase, settings

pytest_plugins = ["transition_coverage_plugin", "driver_fixtures"]

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
