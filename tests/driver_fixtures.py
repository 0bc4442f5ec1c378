"""Fixtures shared by the driver/emulator test modules (registered in conftest.py).

``calbin_path`` writes the default synthetic calbin with the requesting module's ``SEED``;
``runner`` is a ``DirectRunner`` (the synchronous driver harness) on it, closed afterwards.
"""

import pytest

from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.direct import DirectRunner
from calexec.drivers.synthetic import calbin


@pytest.fixture(scope="module")
def calbin_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.module.__name__) / "q.calbin"
    calbin.write(str(path), calbin.default_spec(seed=request.module.SEED))
    return str(path)


@pytest.fixture
def runner(calbin_path):
    r = DirectRunner(CalRT.load(), calbin_path)
    yield r
    r.close()
