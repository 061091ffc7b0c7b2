"""The suite's xdist schedule (tests/conftest.py): files that share a session fixture go to one worker."""

import types

from xdist.scheduler import LoadFileScheduling

from tests.conftest import ROOT, SHARED_UNITS, pytest_xdist_make_scheduler


class _Config:
    """What the scheduler reads of pytest's config."""

    def __init__(self, dist: str):
        self.dist = dist
        self.option = types.SimpleNamespace(loadscopereorder=True)

    def getvalue(self, name: str):
        return {"dist": self.dist, "tx": ["2*popen"]}.get(name)

    def getoption(self, name: str, default=None):
        return {"dist": self.dist, "numprocesses": 2}.get(name, default)


def test_every_shared_unit_is_a_test_file_that_uses_its_fixture():
    for path, unit in SHARED_UNITS.items():
        fixture = unit.rsplit("::", 1)[1]
        assert "def test_" in (text := (ROOT / path).read_text()) and f"({fixture}" in text, path


def test_files_of_a_shared_unit_are_one_scope_and_every_other_file_is_its_own():
    config = _Config("loadfile")
    sched = pytest_xdist_make_scheduler(config, log=None)
    assert isinstance(sched, LoadFileScheduling)
    # The collection's order (heaviest files first), not xdist's most-tests-first.
    assert config.option.loadscopereorder is False
    a, b = (sched._split_scope(f"{path}::test_x") for path in SHARED_UNITS)
    assert a == b == "tests/e2e/conftest.py::mnli_run"
    assert sched._split_scope("tests/e2e/test_quickstart.py::test_y[z]") == "tests/e2e/test_quickstart.py"
    assert pytest_xdist_make_scheduler(_Config("load"), log=None) is None  # other modes: xdist's own
