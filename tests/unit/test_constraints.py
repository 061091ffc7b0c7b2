"""constraints.txt is the stack the suite runs on: what is installed is what is pinned, and pyproject's ranges
(what library users get) admit every pin."""

import tomllib
from packaging.requirements import Requirement

from tests.conftest import ROOT
from tools import constraints


def test_installed_packages_are_the_pinned_ones():
    assert constraints.differences() == [], (
        "installed packages differ from constraints.txt; install with "
        '`pip install -e ".[dev,qlora]" -c constraints.txt`, or, for a deliberate upgrade with a green suite, '
        "run `python tools/constraints.py` and commit constraints.txt"
    )


def test_pyproject_ranges_admit_every_pin():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = constraints.pinned()
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in constraints.EXTRAS for r in project["optional-dependencies"][extra]]
    for req in reqs:
        name = constraints.canonical(req.name)
        assert name in pins, f"{req.name} is a dependency but not pinned in constraints.txt"
        assert req.specifier.contains(pins[name]), f"pyproject's {req} excludes the pinned {pins[name]}"


def test_the_pins_file_parses_as_exact_pins(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("# comment\nFoo_Bar==1.2.3  # why\n\nbaz==4\n")
    assert constraints.pinned(f) == {"foo-bar": "1.2.3", "baz": "4"}
