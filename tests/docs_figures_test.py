"""docs/benchmarks.md's figures: the one command draws every figure the docs show.

Runs `jax_m2n.bench.docs_figures.write_docs` (what `python -m jax_m2n.bench.plots --docs`
runs) on the checked-in docs/bench_results into a temporary folder and checks that it
writes every figure of its list, that its list is exactly the figures the docs embed
(`figures/<name>` in docs/*.md), that each is checked in under docs/figures, and that a
figure whose JSON is absent is skipped rather than failing. No pixels compared.
"""

import glob
import os
import re

import pytest

from jax_m2n.bench import docs_figures

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _embedded() -> set[str]:
  names = set()
  for path in glob.glob(os.path.join(DOCS, "*.md")):
    with open(path) as f:
      names.update(re.findall(r"\bfigures/([\w.-]+\.(?:png|svg))", f.read()))
  return names


def test_the_generator_list_is_the_docs_list():
  listed = [f.name for f in docs_figures.FIGURES]
  assert len(set(listed)) == len(listed)
  assert _embedded() == set(listed)
  for name in listed:
    assert os.path.isfile(os.path.join(DOCS, "figures", name)), name
  assert sorted(os.listdir(os.path.join(DOCS, "figures"))) == sorted(listed)


def test_every_source_is_checked_in():
  for fig in docs_figures.FIGURES:
    for src in fig.sources:
      assert os.path.isfile(os.path.join(DOCS, "bench_results", src)), (fig.name, src)


def test_the_command_writes_every_figure(tmp_path):
  pytest.importorskip("matplotlib")
  lines = []
  written, skipped = docs_figures.write_docs(os.path.join(DOCS, "bench_results"),
                                             str(tmp_path), lines.append)
  assert skipped == []
  assert sorted(os.listdir(tmp_path)) == sorted(f.name for f in docs_figures.FIGURES)
  for path in written:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
  assert len(lines) == len(docs_figures.FIGURES)


def test_absent_json_is_skipped(tmp_path):
  empty = tmp_path / "results"
  empty.mkdir()
  lines = []
  written, skipped = docs_figures.write_docs(str(empty), str(tmp_path / "out"),
                                             lines.append)
  assert written == []
  assert skipped == [f.name for f in docs_figures.FIGURES]
  assert all(" skipped: " in line for line in lines)
