"""Plans are what they were: the planner's output over a fixed table of cases (the
planner tests', the CLI's, a seeded random table and the planner bench's smoke model)
against digests recorded before the planner was split into a package
(tests/plan_digest.py says what a digest covers and how to regenerate it)."""

import json
import os

import plan_digest

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_digests.json")


def test_plans_identical_to_the_recorded_digests():
  with open(FIXTURE) as f:
    want = json.load(f)
  got = plan_digest.all_digests()
  assert set(got) == set(want)
  changed = [k for k in want if got[k] != want[k]]
  assert not changed, f"{len(changed)} of {len(want)} plans changed, e.g. {changed[:3]}"
