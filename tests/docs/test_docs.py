"""Every ```bash and ```python block of README.md and docs/*.md runs on CPU and passes (or is marked skip with
a reason, or covered by a named test that runs it). One test per page; the convention is in harness.py and
docs/contributing.md.

Pages run two at a time (LORAKIT_DOC_TEST_JOBS; each process gets one OpenMP thread), in the background
from the first page test on, so the whole set takes about as long as its longest half; pytest's durations
charge the waiting to whichever page test comes first. A block may take LORAKIT_DOC_TEST_TIMEOUT seconds
(default 300) before it counts as failed. All pages together share a budget of about 3 minutes on two
cores (`-s` prints each block's time): keep CPU examples to a few steps of a tiny model.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.docs.harness import DEFAULT_TIMEOUT_S, PageResult, discover_pages, doc_env, rel, run_page, weight

PAGES = discover_pages()


class PageRunner:
    """Runs the selected pages in a thread pool (each block is a subprocess), the costliest first."""

    def __init__(self, pages: list[Path], base: Path, jobs: int, timeout: float):
        home = base / "home"
        home.mkdir(parents=True, exist_ok=True)
        self.env = doc_env(home)
        self.pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="doc-test")
        self.futures: dict[Path, Future[PageResult]] = {}
        for page in sorted(pages, key=weight, reverse=True):
            workdir = base / "pages" / page.stem
            self.futures[page] = self.pool.submit(run_page, page, workdir, self.env, timeout)

    def result(self, page: Path) -> PageResult:
        return self.futures[page].result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def page_runner(request, tmp_path_factory):
    selected = [
        item.callspec.params["page"]
        for item in request.session.items
        if getattr(item, "function", None) is test_page and hasattr(item, "callspec")
    ]
    runner = PageRunner(
        selected,
        tmp_path_factory.mktemp("docs"),
        jobs=max(1, int(os.environ.get("LORAKIT_DOC_TEST_JOBS", "2"))),
        timeout=float(os.environ.get("LORAKIT_DOC_TEST_TIMEOUT", DEFAULT_TIMEOUT_S)),
    )
    yield runner
    runner.close()


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_page(page, page_runner):
    result = page_runner.result(page)
    print(result.summary())
    if result.problems or result.failed is not None:
        pytest.fail(result.report(), pytrace=False)
