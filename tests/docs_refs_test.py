"""Docs point at things that exist.

Reads README.md, every docs/*.md, and the comments and docstrings of jax_m2n/**/*.py,
and checks every reference to this repository found there. Fails with one line per
broken reference: "file:line: reference -> why".

What counts as a reference (the rules, in order; a text between backticks is split at
spaces, each word taken alone, with `./`, a trailing `()`/`(...)`, `::test` and `:line`
dropped):
1. A path: a word with a `/` whose first part names a folder of the repository
   (`docs/design.md`, `eager/calls.py`, `xla_ffi/cuda/`, `tests/tunix_*_test.py`,
   `xla_ffi/nic_emulator.{h,cc}`; not `GB/s`) must name a file or folder (or, with
   `*`, match one) under the repository root, under the folder of the file that names
   it, or under `jax_m2n/_src/`, `jax_m2n/` or `xla_ffi/` (docs shorten
   `jax_m2n/_src/eager/calls.py` to `eager/calls.py`); `eager/calls.name` names a
   `name` defined (as in 3) in `eager/calls.py`. In Python comments and docstrings
   such a path counts also outside backticks when it ends in a file type (`.py`,
   `.md`, `.cc`, `.h`, ...).
2. A source file's name alone (`fast_path.py`, `convert.h`; not `results.md`, a
   command's output): some file of the repository has it.
3. A dotted name whose first part is jax_m2n, a module of jax_m2n (`checks.options`,
   `processes.transfer_engine.stats`) or a class of jax_m2n (`Plan.estimate_ms`):
   resolves by importing and `getattr`; failing that, its last part is defined
   (`def`, `class`, `name =`, `name:`, `self.name =`; in C++ a function, a macro or a
   registered `"name"`: the extensions `_ffi`/`_ffi_cuda` are read from their nanobind
   modules) in the source of the part before it, or the whole name is one the C++
   registers (`jax_m2n.cuda.ReshardState`). Past a property or a value (whose type
   the text does not give) the remaining parts must be defined somewhere in jax_m2n.
4. A private name alone (`_async_token`; not `__dunder__`): defined (as in 3) in some
   Python or C++ source of the repository.
Not checked: names and paths of other projects (`jax.*`, `numpy`, `tunix/...`: their
first part is not jax_m2n's; EXTERNAL lists those whose first part is a folder here),
words with a placeholder (`<pid>`), a quote or `=`, Bazel labels (`//tests:x`),
absolute and generated paths (`/usr/...`, `.venv/...`, `bazel-bin/...`) and fenced
code blocks.
"""

import ast
import functools
import glob
import importlib
import importlib.util
import io
import os
import re
import tokenize
import types

import pytest

# The source tree, also under Bazel (the runfiles' links resolve to it): the references
# are to the repository's files, not to what a test's runfiles carry.
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))

# Where a path that is not under the repository root may be written from.
PATH_ROOTS = ("jax_m2n/_src", "jax_m2n", "xla_ffi")
# Paths of other projects that docs and comments name on purpose, whose first part
# is also a folder here.
EXTERNAL = (
    "tests/rl/",         # tunix's own tests that scripts/tunix_upstream_tests.sh runs
    "examples/ffi/",     # JAX's FFI examples, cited as models
)
# File names of other projects (headers the C++ includes, XLA's sources cited) and
# the extensions the build copies into jax_m2n/ (gitignored).
EXTERNAL_FILES = {"nccl.h", "cuda_runtime_api.h", "cuda_runtime.h", "ffi.h", "api.h",
                  "cuda.h", "cpu_client.cc", "_ffi.so", "_ffi_cuda.so"}
GENERATED = (".venv/", "bazel-bin/", "bazel-out/", "bazel-", "/", "$", "~")
# The file types a reference to a source or document ends in (a results.json or a
# plot named by a command is output, not a reference). A file name alone is checked
# for source types only (a bare `results.md` is a command's output).
FILE_TYPES = ("py", "md", "cc", "h", "sh", "bzl", "cu")
SOURCE_TYPES = ("py", "cc", "h", "sh", "bzl", "cu")

_WORD_PATH = re.compile(
    r"(?<![\w./`-])((?:[A-Za-z_.][\w.-]*/)+[\w.*-]*\.(?:"
    + "|".join(FILE_TYPES) + r"))(?![\w/])")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_PRIVATE = re.compile(r"^_[A-Za-z]\w*$")
_FILE = re.compile(r"^\w[\w.+-]*\.(" + "|".join(SOURCE_TYPES) + r")$")
_ANY_FILE = re.compile(r"^[\w.*+-]*\.(" + "|".join(FILE_TYPES) + r")$")


# ------------------------------------------------------------------- the repository

@functools.lru_cache(maxsize=None)
def _files() -> tuple[str, ...]:
  """Every file of the repository (relative paths), build outputs and venvs left out."""
  out = []
  for dirpath, dirnames, files in os.walk(ROOT):
    dirnames[:] = [d for d in dirnames if not d.startswith(("bazel-", ".venv", ".git",
                                                             ".pytest", ".hypothesis",
                                                             "__pycache__"))]
    out += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files]
  return tuple(out)


@functools.lru_cache(maxsize=None)
def _basenames() -> frozenset:
  return frozenset(os.path.basename(f) for f in _files())


def _sources() -> list[str]:
  return [f for f in _files() if f.endswith((".py", ".cc", ".h"))]


@functools.lru_cache(maxsize=None)
def _text(path: str) -> str:
  with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
    return f.read()


def _defines(source: str, name: str, cxx: bool = False) -> bool:
  """Whether `source` (Python, or C++ with `cxx`) defines `name` (rules 3 and 4)."""
  n = re.escape(name)
  if cxx:  # a function or macro, or a name the nanobind module or XLA registers
    pattern = rf"\b{n}\s*\([^;]*\)\s*(const\s*)?(->.*)?{{|#define\s+{n}\b|\"{n}\""
  else:
    pattern = rf"\b(def|class)\s+{n}\b|^\s*{n}\s*[:=]|self\.{n}\s*="
  return bool(re.search(pattern, source, re.M))


def _defined_anywhere(name: str, prefix: str = "") -> bool:
  return any(_defines(_text(f), name, cxx=not f.endswith(".py"))
             for f in _sources() if f.startswith(prefix))


@functools.lru_cache(maxsize=None)
def _modules() -> dict[str, list[str]]:
  """Last part of every module (and package) under jax_m2n/_src -> its dotted names
  (what docs shorten `jax_m2n._src.eager.calls` to: `calls`, `eager.calls`)."""
  out: dict[str, list[str]] = {}
  for f in _files():
    if f.startswith("jax_m2n/_src/") and f.endswith(".py"):
      dotted = f[:-3].replace("/", ".")
      if dotted.endswith(".__init__"):
        dotted = dotted[:-len(".__init__")]
      out.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
  out["_ffi"] = ["jax_m2n._ffi"]
  out["_ffi_cuda"] = ["jax_m2n._ffi_cuda"]
  return out


EXTENSION_SOURCES = {"jax_m2n._ffi": "xla_ffi/module_cpu.cc",
                     "jax_m2n._ffi_cuda": "xla_ffi/cuda/module_cuda.cc"}


def _module_source(dotted: str) -> str | None:
  if dotted in EXTENSION_SOURCES:
    return _text(EXTENSION_SOURCES[dotted])
  for path in (dotted.replace(".", "/") + ".py", dotted.replace(".", "/") + "/__init__.py"):
    if os.path.exists(os.path.join(ROOT, path)):
      return _text(path)
  return None


@functools.lru_cache(maxsize=None)
def _classes() -> dict[str, list[str]]:
  """Class name -> the jax_m2n modules that define it (from the sources, by ast)."""
  out: dict[str, list[str]] = {}
  for last, dotted_names in _modules().items():
    for dotted in dotted_names:
      source = _module_source(dotted)
      if source is None or dotted in EXTENSION_SOURCES:
        continue
      for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
          out.setdefault(node.name, []).append(dotted)
  return out


# ------------------------------------------------------------------- the rules

@functools.lru_cache(maxsize=None)
def _folders() -> frozenset:
  """The name of every folder of the repository."""
  return frozenset(part for f in _files() for part in f.split("/")[:-1])


def _check_path(word: str, where: str) -> str | None:
  """Why the path `word` (named in file `where`) is broken; None when it exists or is
  not a path of this repository (its first part names none of its folders: `GB/s`)."""
  word = word.rstrip("/") or word
  if (word.startswith(EXTERNAL) or word.startswith(GENERATED)
      or word.rsplit("/", 1)[-1] in EXTERNAL_FILES):  # (jax_m2n/_ffi_cuda.so: built)
    return None
  if word.split("/")[0] not in _folders():
    return None
  words = [word]
  brace = re.search(r"\{([^{}]*)\}", word)
  if brace:
    words = [word[:brace.start()] + part + word[brace.end():]
             for part in brace.group(1).split(",")]
  roots = ("", os.path.dirname(where)) + PATH_ROOTS
  for w in words:
    if any(glob.glob(os.path.join(ROOT, root, w)) for root in roots):
      continue
    # `eager/programs.build_programs`: the name build_programs in eager/programs.py.
    module, _, name = w.rpartition(".")
    if _ANY_FILE.match(w.rsplit("/", 1)[-1]) or not name:
      return f"no such file or folder (looked under the root, {', '.join(roots[1:])})"
    found = [os.path.join(root, module + ".py") for root in roots
             if os.path.exists(os.path.join(ROOT, root, module + ".py"))]
    if not found:
      return f"no module {module}.py (looked under the root, {', '.join(roots[1:])})"
    if not any(_defines(_text(os.path.normpath(f)), name) for f in found):
      return f"{found[0]} defines no {name}"
  return None


def _resolve(dotted: str) -> str | None:
  """Why the jax_m2n name `dotted` does not resolve; None when it does, or when it is
  not jax_m2n's (rule 3)."""
  parts = dotted.split(".")
  head = parts[0]
  if head == "jax_m2n":
    starts = ["jax_m2n"]
  elif head in _modules():
    starts = _modules()[head]
  elif head in _classes():
    starts = [f"{m}.{head}" for m in _classes()[head]]
  else:
    return None  # another project's name
  why = "no candidate"
  for start in starts:
    why = _resolve_from(start, parts[1:])
    if why is None:
      return None
  return why


def _resolve_from(start: str, rest: list[str]) -> str | None:
  names = start.split(".") + rest
  for ext, src in EXTENSION_SOURCES.items():  # an extension not built in this checkout
    parts = ext.split(".")                     # (no CUDA here): its C++ source says
    if names[:len(parts)] == parts and importlib.util.find_spec(ext) is None:
      after = names[len(parts):]
      if after and not _defines(_text(src), after[0], cxx=True):
        return f"{ext} (not built; its source {src}) has no {after[0]}"
      return None
  # The longest importable module prefix, then attributes.
  obj, i = None, len(names)
  while i > 0:
    try:
      obj = importlib.import_module(".".join(names[:i]))
      break
    except ImportError:
      i -= 1
  if obj is None:
    return f"cannot import {names[0]}"
  owner = ".".join(names[:i])
  for j in range(i, len(names)):
    if not isinstance(obj, (type, types.ModuleType)):
      # Past a property or a value the type is not known from the text: the rest
      # must be defined somewhere in jax_m2n's sources.
      missing = [n for n in names[j:] if not _defined_anywhere(n, "jax_m2n/")]
      return f"{missing[0]} is defined nowhere in jax_m2n" if missing else None
    try:
      obj = getattr(obj, names[j])
      owner = ".".join(names[:j + 1])
    except AttributeError:
      # Rule 3's fallback: defined in the source of the last module reached (a field,
      # an attribute set in __init__, a name of a native extension).
      module = owner
      while module and _module_source(module) is None:
        module = module.rpartition(".")[0]
      source = _module_source(module) if module else None
      if j == len(names) - 1 and source is not None and _defines(
          source, names[j], cxx=module in EXTENSION_SOURCES):
        return None
      if _defined_anywhere(".".join(names), "xla_ffi/"):
        return None  # a name the C++ registers (an FFI type: jax_m2n.cuda.ReshardState)
      return f"{owner} has no {names[j]}"
  return None


def _check_word(word: str, where: str) -> str | None:
  """Why one backticked word is a broken reference; None when fine or not checked."""
  word = re.sub(r"^\./", "", word.rstrip(".,;:)"))
  word = re.sub(r"\(.*\)?$", "", word)          # a call: name(...) -> name
  word = re.sub(r"::.*$|:\d+(-\d+)?$", "", word)   # pytest ids, line numbers
  if (not word or word.startswith("//") or any(c in word for c in "=<'\"[")):
    return None  # a label, an assignment, a placeholder, a string, an index
  if word in EXTERNAL_FILES:
    return None
  if "/" in word:
    return _check_path(word, where)
  if _FILE.match(word):
    if word in _basenames():
      return None
    return "no file of the repository has this name"
  if _PRIVATE.match(word):
    if _defined_anywhere(word):
      return None
    return "defined nowhere in the repository's sources"
  if _DOTTED.match(word):
    return _resolve(word)
  return None


# ------------------------------------------------------------------- the texts

def _markdown_spans(path: str):
  """(line, backticked text) of a markdown file, fenced code blocks left out."""
  fenced = False
  for n, line in enumerate(_text(path).splitlines(), 1):
    if line.lstrip().startswith("```"):
      fenced = not fenced
      continue
    if not fenced:
      for span in re.findall(r"`([^`]+)`", line):
        yield n, span


def _python_texts(path: str):
  """(line, text) of every comment and docstring of a Python file."""
  source = _text(path)
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      yield tok.start[0], tok.string
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=False)
      if doc:
        first = node.body[0].lineno
        for k, line in enumerate(doc.splitlines()):
          yield first + k, line


def _python_spans(path: str):
  for n, text in _python_texts(path):
    spans = re.findall(r"`([^`]+)`", text)
    yield from ((n, s) for s in spans)
    bare = re.sub(r"`[^`]*`", " ", text)
    yield from ((n, p) for p in _WORD_PATH.findall(bare))


def _documents() -> list[str]:
  docs = sorted(f for f in _files() if f.startswith("docs/") and f.endswith(".md"))
  return ["README.md"] + docs


def _python_files() -> list[str]:
  return sorted(f for f in _files() if f.startswith("jax_m2n/") and f.endswith(".py"))


def _broken(path: str, spans) -> list[str]:
  out = []
  for n, span in spans:
    for word in span.split():
      why = _check_word(word, path)
      if why:
        out.append(f"{path}:{n}: {word} -> {why}")
  return out


@pytest.mark.parametrize("path", _documents())
def test_markdown_references_exist(path):
  broken = _broken(path, _markdown_spans(path))
  assert not broken, "\n".join(broken)


def test_python_comment_and_docstring_references_exist():
  broken = []
  for path in _python_files():
    broken += _broken(path, _python_spans(path))
  assert not broken, "\n".join(broken)


# A line that is one upper-case word with an underscore (AUTO_TABLE): a placeholder a
# generated table or text was to replace, left in a document.
PLACEHOLDER = re.compile(r"^\s*[A-Z][A-Z0-9]*_[A-Z0-9_]+\s*$")


def _placeholders(path: str) -> list[str]:
  out, fenced = [], False
  with open(os.path.join(ROOT, path)) as f:
    for n, line in enumerate(f, 1):
      if line.lstrip().startswith("```"):
        fenced = not fenced
      elif not fenced and PLACEHOLDER.match(line):
        out.append(f"{path}:{n}: {line.strip()} -> a placeholder left in the text")
  return out


@pytest.mark.parametrize("path", _documents())
def test_no_placeholder_is_left(path):
  left = _placeholders(path)
  assert not left, "\n".join(left)


# ------------------------------------------------------------------- the rules' own test

@pytest.mark.parametrize("word, broken", [
    ("docs/design.md", False), ("eager/calls.py", False), ("xla_ffi/cuda/", False),
    ("tests/tunix_*_test.py", False), ("xla_ffi/nic_emulator.{h,cc}", False),
    ("docs/nothing.md", True), ("xla_ffi/nic_emulator.{h,cpp}", True),
    ("fast_path.py", False), ("ops.py", True),
    ("checks.options", False), ("jax_m2n.plan()", False), ("Plan.estimate_ms", False),
    ("processes.transfer_engine.stats", False), ("_ffi.abort", False),
    ("checks.no_such_rule", True), ("jax_m2n.nothing", True), ("Plan.nothing", True),
    ("_async_token", False), ("_wait_for_nobody", True),
    ("jax.device_put", False), ("tunix/sft/sharding_utils.py:68", False),
    ("jax_m2n/addr/<pid>", False), ("//tests:planner_test", False),
])
def test_the_rules(word, broken):
  assert bool(_check_word(word, "docs/design.md")) == broken, _check_word(
      word, "docs/design.md")
