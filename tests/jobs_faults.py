"""Faults the jobs tests inject into a live Publisher in their own process (shared by
jobs_relay_test.py and jobs_operate_test.py): a relay member made to look dead."""

import socket


def pass_over(pub, version, member):
  """Makes relay member `member` of `version` look dead to the next one: its address
  in the coordinator's record points at a closed port. Returns that address."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    closed = f"127.0.0.1:{s.getsockname()[1]}"
  for (v, _), r in pub._service._relay._relays.items():
    if v == version:
      r.members[member].address = closed
  return closed
