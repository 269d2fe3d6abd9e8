"""The benchmark tables in docs/router.md are the committed results' (``bench/results/*.json``) as the
benches print them with ``--print``, so a table cannot drift from the summary it claims to show
(one did: a re-run updated the JSON and the prose but left the tables of the run before)."""

from __future__ import annotations

import contextlib
import io

import pytest

from bench import admission_threshold, routing_worlds
from tests.helpers import ROOT


@pytest.mark.parametrize("bench", [routing_worlds, admission_threshold], ids=["routing_worlds", "admission_threshold"])
def test_the_docs_show_the_tables_of_the_committed_results(bench):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--print"]) == 0
    tables = out.getvalue().strip()
    assert tables.count("\n| ") >= 15  # rows were printed
    docs = (ROOT / "docs" / "router.md").read_text()
    missing = [line for line in tables.splitlines() if line and line not in docs]
    name = bench.__name__.split(".")[-1]
    assert not missing, f"docs/router.md lacks {len(missing)} lines of `python bench/{name}.py --print`"
    assert tables in docs, "docs/router.md has the lines but not as printed (rerun the bench's --print)"
