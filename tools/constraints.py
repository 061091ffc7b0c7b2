"""The exact versions lorakit's suite was last green with: `constraints.txt`, read and written here.

    python tools/constraints.py            # rewrite constraints.txt from what is installed now
    python tools/constraints.py --check    # exit 1 listing every difference

constraints.txt pins every distribution that `pip install -e ".[dev,qlora]"` brings in (the dependency
closure of lorakit with those extras, as installed), so CI and README installs get the tested stack while
pyproject.toml keeps ranges for library users. Upgrading a pin: upgrade the package, run the suite green,
run this script, commit both together. tests/test_constraints.py checks installed == pinned.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
FILE = ROOT / "constraints.txt"
EXTRAS = ("dev", "qlora")
# torch is installed first, by hand, from a CPU wheel (README, .ci/run); its local label (+cpu) is the
# build, not the version, so the pin leaves it out.
HEADER = """\
# The versions lorakit's test suite was last green with (CPU, Python {python}).
# pip install torch==2.13.0 && pip install -e ".[dev,qlora]" -c constraints.txt
# Regenerate with `python tools/constraints.py` after a deliberate upgrade and a green suite.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requires(extras: tuple[str, ...], pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """lorakit's own requirements with `extras`, read from this checkout's pyproject.toml rather than from
    the installed distribution's metadata, which is that of whichever checkout was installed (editable)
    and lags behind a branch that changes its dependencies."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return lines


def closure(root: str = "lorakit", extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """{canonical name: installed version} of every distribution `root[extras]` needs, `root` excluded."""
    env = default_environment()
    found: dict[str, str] = {}
    todo = [(root, tuple(extras))]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        if canonical(name) == canonical(root):
            lines = project_requires(wanted)
        else:
            dist = metadata.distribution(name)
            found[canonical(name)] = dist.version
            lines = dist.requires or []
        for line in lines:
            req = Requirement(line)
            if req.marker is not None and not any(
                req.marker.evaluate({**env, "extra": e}) for e in (wanted or ("",))
            ):
                continue
            todo.append((req.name, tuple(sorted(req.extras))))
    return dict(sorted(found.items()))


def pinned(path: Path = FILE) -> dict[str, str]:
    """{canonical name: version} read from a constraints file."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[canonical(name)] = version.strip()
    return out


def _base(version: str) -> str:
    return version.split("+", 1)[0]


def differences(path: Path = FILE) -> list[str]:
    """What differs between the installed closure and the pins, one line each (empty: they agree)."""
    have, want = closure(), pinned(path)
    out = [
        f"{n}: installed {have[n]}, pinned {want.get(n, '(not pinned)')}"
        for n in have
        if _base(have[n]) != want.get(n)
    ]
    out += [
        f"{n}: pinned {want[n]}, not needed by lorakit[{','.join(EXTRAS)}]" for n in want if n not in have
    ]
    return out


def write(path: Path = FILE) -> None:
    """Write the pins of what is installed now."""
    python = ".".join(map(str, sys.version_info[:2]))
    body = "".join(f"{n}=={_base(v)}\n" for n, v in closure().items())
    path.write_text(HEADER.format(python=python) + body)


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        diff = differences()
        print("\n".join(diff) or "installed packages match constraints.txt")
        sys.exit(1 if diff else 0)
    write()
    print(f"wrote {FILE}")
