"""jax_m2n/_src imports one way: no cycle, no import back up a layer, none hidden inside
a function, and no underscore name taken from another module (each module's opening
comment says what it owns; this keeps the rooms apart as they grow).

Reads the sources with `ast`: nothing is imported, so it runs in milliseconds and fails
naming the offending module and line.
"""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "jax_m2n", "_src")

# Lowest first. A module may import modules of its own layer or below, never above.
# A package (planner/, processes/, eager/) is one entry: its modules share its layer.
LAYERS = [
    ("errors", "request", "jax_compat", "transfer_server", "quantize_numerics",
     "collector"),
    ("layout", "topology"),
    ("planner",),
    ("schedule", "ffi"),
    ("local_copy", "local_memory", "lent_memory"),
    ("checks", "call_plan"),
    ("processes",),
    ("eager",),
    ("traced",),
    ("transforms",),
    ("traced_leaves", "fast_path", "quantize"),
    ("api", "jobs"),
    ("torch",),  # jax_m2n.torch: a torch process's side of the jobs (imports torch)
    ("cli",),  # the command line: `plan` and `jobs status` (jobs/status.py)
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules():
  """{dotted name under _src: path}."""
  out = {}
  for dirpath, _, files in os.walk(ROOT):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
        if rel == "__init__":  # _src's own (Bazel's runfiles add an empty one)
          continue
        out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = (
            os.path.join(dirpath, f))
  return out


MODULES = _modules()
PREFIX = "jax_m2n._src."


def _targets(node: ast.AST):
  """(module under _src, imported name or None) of an import statement."""
  if isinstance(node, ast.Import):
    for a in node.names:
      if a.name.startswith(PREFIX):
        yield a.name[len(PREFIX):], None
  elif isinstance(node, ast.ImportFrom) and node.module and (
      node.module.startswith(PREFIX) or node.module == "jax_m2n._src"):
    base = node.module[len(PREFIX):] if node.module != "jax_m2n._src" else ""
    for a in node.names:
      sub = f"{base}.{a.name}" if base else a.name
      if sub in MODULES:  # `from package import module`
        yield sub, None
      else:
        yield base, a.name


def _imports():
  """[(importer, imported, name, line, nested)] for every import of an _src module."""
  out = []
  for mod, path in MODULES.items():
    tree = ast.parse(open(path).read(), path)
    nested = set()
    for fn in ast.walk(tree):
      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.If)):
        for n in ast.walk(fn):
          if n is not fn and isinstance(n, (ast.Import, ast.ImportFrom)):
            nested.add(id(n))
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        for target, name in _targets(node):
          out.append((mod, target, name, node.lineno, id(node) in nested))
  return out


def _layer(mod: str) -> int:
  return RANK[mod.split(".")[0]]


def test_every_module_has_a_layer():
  missing = sorted(m for m in MODULES if m.split(".")[0] not in RANK)
  assert not missing, f"add these modules to LAYERS: {missing}"


def test_no_import_goes_up_a_layer_or_hides_in_a_function():
  bad = [f"{a} (line {line}) imports {b}" + (" inside a function or if" if nested else "")
         for a, b, _, line, nested in _imports()
         if b and (nested or _layer(b) > _layer(a))]
  assert not bad, "\n".join(bad)


def test_no_import_cycle():
  graph = {}
  for a, b, _, _, _ in _imports():
    if b and b != a:
      graph.setdefault(a, set()).add(b)
  state, path = {}, []

  def visit(m):
    state[m] = "open"
    path.append(m)
    for n in sorted(graph.get(m, ())):
      if state.get(n) == "open":
        raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
      if n not in state:
        visit(n)
    path.pop()
    state[m] = "done"

  for m in sorted(MODULES):
    if m not in state:
      visit(m)


def test_no_underscore_name_is_imported_across_modules():
  """A name another module needs is module-public (a package's modules included)."""
  bad = [f"{a} (line {line}) imports {b}.{name}" for a, b, name, line, _ in _imports()
         if name and name.startswith("_")]
  assert not bad, "\n".join(bad)
