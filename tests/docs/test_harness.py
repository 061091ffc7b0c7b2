"""The doc-test harness itself, on fake pages: failures name the page and line and show the output, skipped
blocks do not run, blocks share their directory, markers and covered-by claims are checked."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from tests.docs.harness import (
    Block,
    DocTestError,
    check_covered,
    doc_env,
    parse_page,
    run_page,
)


@pytest.fixture()
def site(tmp_path):
    """A fake repository: a recipes/ directory, a test file and a CI script for covered-by."""
    root = tmp_path / "repo"
    (root / "recipes").mkdir(parents=True)
    (root / "recipes" / "tiny.yaml").write_text("model: {name_or_path: tiny:t5}\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_cli.py").write_text(
        textwrap.dedent(
            '''
            """python -m tool.run recipes/tiny.yaml, as the docs give it."""
            def run_cli(module, *args):
                pass

            def test_runs():
                run_cli("tool.merge", "runs/x", "--output", "out")

            class TestGroup:
                def test_inner(self):
                    pass
            '''
        )
    )
    (root / "ci").write_text("set -e\npython -m pip install -q -e .\npython -m pytest -q\n")
    return root


def page(root: Path, text: str, name: str = "page.md") -> Path:
    path = root / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def run(root: Path, text: str, timeout: float = 60):
    return run_page(page(root, text), root.parent / "work", doc_env(root.parent / "home"), timeout, root=root)


def test_a_failing_block_fails_the_page_naming_page_line_and_output(site):
    result = run(
        site,
        """
        # Title

        ```bash
        echo first
        ```

        ```bash
        echo "about to fail"
        false
        echo never
        ```

        ```bash
        echo "not reached"
        ```
        """,
    )
    assert [r.returncode for r in result.results] == [0, 1]  # stops at the failure
    report = result.report()
    assert "page.md:7: ```bash block failed (exit code 1)" in report
    assert "about to fail" in report and "never" not in report.split("output")[-1]
    assert "not reached" not in report


def test_pipefail_and_unset_variables_fail(site):
    assert run(site, "```bash\nfalse | cat\n```\n").failed is not None
    assert run(site, '```bash\necho "$NOT_SET_ANYWHERE"\n```\n').failed is not None


@pytest.mark.slow
def test_a_skipped_block_is_not_run_and_needs_a_reason(site):
    result = run(
        site,
        """
        <!-- doc-test: skip needs 8 GPUs -->
        ```bash
        touch ran && exit 1
        ```

        ```python
        import os
        assert not os.path.exists("ran")
        ```
        """,
    )
    assert result.failed is None and not result.problems
    assert len(result.results) == 1 and result.blocks[0].skip == "needs 8 GPUs"
    assert not (site.parent / "work" / "ran").exists()
    with pytest.raises(DocTestError, match="skip needs a reason"):
        parse_page(page(site, "<!-- doc-test: skip -->\n```bash\ntrue\n```\n"))


@pytest.mark.slow
def test_later_blocks_see_what_earlier_ones_wrote_and_recipes_are_there(site):
    result = run(
        site,
        """
        ```bash
        mkdir -p out && cp recipes/tiny.yaml out/copy.yaml
        python -c "import sys; open('out/python.txt', 'w').write(sys.executable)"
        ```

        ```python
        import sys
        from pathlib import Path

        assert Path("out/copy.yaml").read_text().startswith("model:")
        assert Path("out/python.txt").read_text() == sys.executable
        Path("out/seen").write_text("yes")
        ```
        """,
    )
    assert result.failed is None, result.report()
    work = site.parent / "work"
    assert (work / "out" / "seen").read_text() == "yes"
    assert (work / "out" / "python.txt").read_text() == sys.executable
    # A copy, not a link: a page that writes into ./recipes leaves the repository alone.
    assert not (work / "recipes").is_symlink()


def test_a_transcript_runs_only_its_commands(site):
    result = run(
        site,
        """
        ```bash
        $ echo hello > greeting
        hello world (this line is output, never run)
        $ test -f greeting
        ```
        """,
    )
    assert result.failed is None, result.report()


def test_a_block_that_hangs_times_out(site):
    result = run(site, "```bash\nsleep 30\n```\n", timeout=1)
    assert result.failed is not None and result.failed.timed_out
    assert "timed out" in result.report()


@pytest.mark.parametrize(
    "text, message",
    [
        ("```sh\nls\n```\n", "```sh: use ```bash or ```python"),
        ("```\nls\n```\n", "a fence without a language"),
        ("<!-- doc-test: skip reason -->\n\n```bash\nls\n```\n", "not immediately followed by a code fence"),
        ("<!-- doc-test: skip reason -->\n```yaml\na: 1\n```\n", "before a ```yaml block, which never runs"),
        ("<!-- doc-test: skpi reason -->\n```bash\nls\n```\n", "unknown doc-test marker"),
        ("```bash\nls\n", "never closed"),
        ("Run it:\n\n    python -m lorakit.run recipes/x.yaml\n", "a command in an indented code block"),
    ],
)
def test_pages_that_break_the_convention_are_refused(site, text, message):
    with pytest.raises(DocTestError, match=re.escape(message)) as err:
        parse_page(page(site, text))
    assert "line " in str(err.value)
    # run_page reports the problem instead of running anything.
    result = run(site, text)
    assert result.problems and not result.results


def test_what_is_shown_not_run(site):
    blocks = parse_page(
        page(
            site,
            """
            A synopsis may sit in an indented block:

                python -m lorakit.run RECIPE [KEY=VALUE ...]

            ```yaml
            train: {lr: 1.0e-3}
            ```

            1. In a list:

               ```python
               print("indented with the list item")
               ```
            """,
        )
    )
    assert [(b.lang, b.runs) for b in blocks] == [("yaml", False), ("python", True)]
    assert blocks[1].code == 'print("indented with the list item")\n'


def covered(site: Path, target: str, code: str) -> Block:
    return Block(page=site / "page.md", line=3, lang="bash", code=code, covered_by=target)


def test_covered_by_a_test_needs_the_test_and_the_command(site):
    check_covered(
        covered(site, "tests/test_cli.py::test_runs", "python -m tool.run recipes/tiny.yaml\n"), site
    )
    # The same module with the same --options counts as the same command.
    check_covered(
        covered(site, "tests/test_cli.py::test_runs", "python -m tool.merge runs/a --output b\n"), site
    )
    check_covered(
        covered(site, "tests/test_cli.py::TestGroup::test_inner", "python -m tool.run recipes/tiny.yaml\n"),
        site,
    )
    with pytest.raises(DocTestError, match="no test test_missing"):
        check_covered(
            covered(site, "tests/test_cli.py::test_missing", "python -m tool.run recipes/tiny.yaml\n"), site
        )
    with pytest.raises(DocTestError, match="no test TestGroup"):  # a class is not a test
        check_covered(
            covered(site, "tests/test_cli.py::TestGroup", "python -m tool.run recipes/tiny.yaml\n"), site
        )
    with pytest.raises(DocTestError, match="does not run: python -m tool.run recipes/other.yaml"):
        check_covered(
            covered(site, "tests/test_cli.py::test_runs", "python -m tool.run recipes/other.yaml\n"), site
        )
    with pytest.raises(DocTestError, match="does not run"):
        check_covered(
            covered(site, "tests/test_cli.py::test_runs", "python -m tool.merge runs/a --force\n"), site
        )
    with pytest.raises(DocTestError, match="no file"):
        check_covered(
            covered(site, "tests/nope.py::test_runs", "python -m tool.run recipes/tiny.yaml\n"), site
        )


def test_covered_by_a_script_matches_its_lines(site):
    check_covered(covered(site, "ci", "pip install -e .    # a comment\npython -m pytest -q\n"), site)
    check_covered(covered(site, "ci", "$ pip install -e .\n...output...\n"), site)
    with pytest.raises(DocTestError, match="does not run: pip install torch"):
        check_covered(covered(site, "ci", "pip install torch\npython -m pytest -q\n"), site)
