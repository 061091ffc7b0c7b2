"""Every ```bash and ```python block of README.md and docs/*.md runs on CPU and passes (or is marked skip with
a reason, or covered by a named test that runs it). One test per page; the convention is in harness.py and
docs/contributing.md.

Pages run two at a time (LORAKIT_DOC_TEST_JOBS; each process gets one OpenMP thread), in the background
from the first page test on, so the whole set takes about as long as its longest half. Every `python` of a
block is a child forked from one interpreter that imported torch, transformers and lorakit once (zygote.py:
about 8 s of imports saved per command, ~65 commands), or a fresh interpreter where a command changes its
environment or passes interpreter options. pytest's durations charge the waiting to whichever page test
comes first. A block may take LORAKIT_DOC_TEST_TIMEOUT seconds (default 300) before it counts as failed.
All pages together share a budget of about 3 minutes on two cores (`-s` prints each block's time): keep CPU
examples to a few steps of a tiny model.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.docs.harness import DEFAULT_TIMEOUT_S, PageResult, discover_pages, doc_env, rel, run_page, weight
from tests.docs.zygote import Zygote

PAGES = discover_pages()


class PageRunner:
    """Runs the selected pages in a thread pool (each block is a subprocess), the costliest first."""

    def __init__(self, pages: list[Path], base: Path, jobs: int, timeout: float):
        home = base / "home"
        home.mkdir(parents=True, exist_ok=True)
        self.zygote = Zygote(doc_env(home), base, log=base / "zygote.log")
        self.env = self.zygote.env
        self.pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="doc-test")
        self.futures: dict[Path, Future[PageResult]] = {}
        for page in sorted(pages, key=weight, reverse=True):
            workdir = base / "pages" / page.stem
            self.futures[page] = self.pool.submit(self._run, page, workdir, timeout)

    def _run(self, page: Path, workdir: Path, timeout: float) -> PageResult:
        # Until the server has imported everything (~10 s) a command would pay the imports itself, beside it.
        self.zygote.wait_ready(timeout=120)
        return run_page(page, workdir, self.env, timeout, python=self.zygote.python)

    def result(self, page: Path) -> PageResult:
        return self.futures[page].result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.zygote.close()


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
