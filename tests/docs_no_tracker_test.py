"""Docs speak to users: no tracker numbers in README.md or docs/**/*.md.

A reader who installs the package cannot look up "issue 42"; where a reason matters
the text says the reason. Fails with one line per hit: "file:line: text".

What counts as a tracker number (case-insensitive; anywhere in the text, code blocks
included):
- `issue`, `issues`, `ticket`, `bug`, `PR`, `pull request` followed by a number, with
  or without `#` or `-` between ("issue 42", "Issue #42", "issues 42, 43", "issues
  42-44", "issue-42", "PR 12", "pull request #7");
- `#` and a number not glued to a word, a path or an HTML entity ("(#42)", "see #42");
- this project's own `jax_m2n#42`.
Not counted: another project's issue or pull request named with its link on the same
line (`[jax#12345](https://github.com/jax-ml/jax/issues/12345)`, "GitHub issue 12345
(https://github.com/jax-ml/jax/issues/12345)"), `owner/repo#N` of another project,
colours and entities (`#f2f2f2`, `&#123;`), Markdown headings (`## 3.`).
"""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))

_WORD_NUMBER = re.compile(
    r"\b(?:issues?|tickets?|bugs?|PRs?|pull\s+requests?)[\s#-]*#?\s*(\d+)\b", re.I)
_HASH_NUMBER = re.compile(r"(?<![\w/&#])#(\d+)\b")
_OWN = re.compile(r"\bjax_m2n#(\d+)\b")
# A link to another project's tracker: the number it names is that project's.
_LINKED = re.compile(r"https?://\S+/(?:issues|pull|pulls|discussions)/(\d+)")


def hits(text: str) -> list[tuple[int, str]]:
  """(line number, the matched text) of every tracker number in `text`."""
  out = []
  for n, line in enumerate(text.splitlines(), 1):
    linked = set(_LINKED.findall(line))
    for pattern in (_WORD_NUMBER, _HASH_NUMBER, _OWN):
      for m in pattern.finditer(line):
        if pattern is not _OWN and m.group(1) in linked:
          continue
        out.append((n, m.group(0)))
  return out


def _documents() -> list[str]:
  docs = glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
  return ["README.md"] + sorted(os.path.relpath(d, ROOT) for d in docs)


def test_documents_are_found():
  documents = _documents()
  assert "docs/benchmarks.md" in documents and "docs/index.md" in documents, documents


@pytest.mark.parametrize("path", _documents())
def test_no_tracker_numbers(path):
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    found = hits(f.read())
  assert not found, "\n".join(f"{path}:{n}: {text!r}" for n, text in found)


@pytest.mark.parametrize("text, flagged", [
    ("as issue 42 found", True),
    ("Issue #42 says", True),
    ("(issues 42, 43, 44)", True),
    ("issues 42-44 on issue 31's emulator", True),
    ("issue-42", True),
    ("fixed in PR 12", True),
    ("see pull request #7", True),
    ("a ticket 3 item", True),
    ("(#42)", True),
    ("see #42.", True),
    ("jax_m2n#42", True),
    ("GitHub issue 12345 (https://github.com/jax-ml/jax/issues/12345)", False),
    ("[jax#12345](https://github.com/jax-ml/jax/issues/12345)", False),
    ("openxla/xla#9876", False),
    ("fill: #f2f2f2; &#123;", False),
    ("## 3. Results", False),
    ("one thread issues at a time; 42 issues were fixed", False),
    ("the 4-GPU issue", False),
])
def test_the_rules(text, flagged):
  assert bool(hits(text)) == flagged, hits(text)
