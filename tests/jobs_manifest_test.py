"""A manifest as it arrives (jobs/manifest.py `from_json`): its id is the digest of its
JSON whatever the body it was read from held besides, equal shapes are one tuple, and
each malformed field is refused with its own message before anything is planned."""

import copy

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_m2n._src.jobs import manifest, messages
from jax_m2n._src.jobs.messages import ProtocolError

PROCESSES = [("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "h", "net")]


def _body(skeleton: bool = True) -> dict:
  """The JSON of a 3-leaf manifest as the wire carries it (parsed from its bytes)."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  tree = {"a": jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("x"))),
          "b": jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("x"))),
          "c": jax.device_put(np.zeros((3,), np.int32), NamedSharding(mesh, P()))}
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  m = manifest.build([x for _, x in flat], [manifest.key_path(p) for p, _ in flat],
                     [x.dtype for _, x in flat],
                     manifest.skeleton_of(tree) if skeleton else None, PROCESSES)
  return messages.parse_object(messages.encode(m.to_json())), m


@pytest.mark.parametrize("skeleton", [True, False])
def test_the_id_is_the_digest_of_the_manifests_json(skeleton):
  body, built = _body(skeleton)
  m = manifest.from_json(body)
  assert m.id == built.id == manifest.digest(m.to_json())
  assert m.to_json() == built.to_json()


def test_fields_outside_the_manifest_and_a_missing_skeleton_do_not_change_the_id():
  body, built = _body(skeleton=False)
  del body["skeleton"]
  body["extra"] = [1, 2, 3]
  m = manifest.from_json(body)
  assert m.skeleton is None and m.id == built.id == manifest.digest(m.to_json())


def test_leaves_of_equal_shapes_share_one_tuple():
  m = manifest.from_json(_body()[0])
  a, b, c = m.leaves
  assert a.shape == (8, 4) and a.shape is b.shape and c.shape == (3,)


def _broken(edit) -> dict:
  body = copy.deepcopy(_body()[0])
  edit(body)
  return body


@pytest.mark.parametrize("edit, message", [
    (lambda b: b["leaves"][1].__setitem__(0, "['b']"),
     "manifest: a leaf's path must be a list of key strings."),
    (lambda b: b["leaves"][1].__setitem__(0, ["x" * 1001]),
     "manifest: a leaf's path must be a list of key strings."),
    (lambda b: b["leaves"][2].__setitem__(1, [3.0]),
     "manifest shape: must hold ints in [0, 4611686018427387903]; got 3.0."),
    (lambda b: b["leaves"][2].__setitem__(1, [True]),
     "manifest shape: must hold ints in [0, 4611686018427387903]; got True."),
    (lambda b: b["leaves"][0].__setitem__(2, "float128"),
     "manifest: dtype must be one of"),
    (lambda b: b["leaves"][0].__setitem__(3, 7),
     "manifest: a leaf must name a listed layout."),
    (lambda b: b["leaves"][1].__setitem__(1, [4, 4]),
     "manifest: every box must lie inside its leaf's shape (4, 4); got ((4, 6), (0, 4))."),
    (lambda b: b["leaves"].append([["['d']"], [3]]),
     "manifest: a leaf must be [path, shape, dtype, layout]."),
])
def test_each_malformed_field_gets_its_own_message(edit, message):
  with pytest.raises(ProtocolError) as e:
    manifest.from_json(_broken(edit))
  assert str(e.value).startswith(message), str(e.value)
