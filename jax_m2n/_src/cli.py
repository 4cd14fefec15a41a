"""The `python -m jax_m2n` command line: `plan` shows and prices a reshard; `jobs
status` asks a running Publisher how it is.

Owns argument parsing and output formats (text and the JSON contract of `plan --json`).
Plans device-free from compact descriptors, so a 256-GPU cluster can be planned on a
laptop. Errors are one line on stderr with exit status 2, never a traceback; a plan over
the planner's size limits is refused from the layouts before any planning. `jobs
status` reads its token from the environment or a file, never from the command line
(argv is visible to every user of the machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
from typing import Sequence

import numpy as np

from jax_m2n._src.errors import ReshardError, ReshardRuntimeError
from jax_m2n._src.jobs import status as jobs_status
from jax_m2n._src.layout import MAX_DIM, box_size, check_shape, parse_mesh_spec
from jax_m2n._src.planner import (DEFAULT_TRANSPORT, ROUTES, TRANSPORTS, Chunking,
                                  check_plan_size, plan_reshard)
from jax_m2n._src.topology import DEFAULT_NIC_GBPS, DEFAULT_NVLINK_GBPS, Topology

USAGE = """python -m jax_m2n plan --shape 4,8 --dtype float32 \\
    --src "mesh(dp=1, tp=4) P(tp, None) @0" --dst "mesh(dp=2, tp=2) P(tp, None) @4" \\
    [--domain-size N] [--nic-gbps X] [--nvlink-gbps Y] \\
    [--route hierarchical|flat|gather_bcast] [--chunk-bytes B] [--transport cpu|cuda] \\
    [--json] [-v]"""

GRAMMAR = """layouts (--src, --dst):
  mesh(NAME=SIZE, ...) P(ENTRY, ...) [@FIRST]
    mesh      named axes, row-major; devices FIRST, FIRST+1, ... (FIRST defaults to 0)
    P(...)    a PartitionSpec, one entry per tensor dim: None (replicated), an axis
              name, or a tuple of axis names (split by their product, first major).
              As in JAX, a shorter P leaves the trailing dims replicated: P() for any
              rank is fully replicated, P(tp) for rank 2 is P(tp, None).
  e.g. "mesh(dp=2, tp=4) P(tp, None) @8" on shape 16,1024: devices 8..15, rows split
  4 ways over tp, each split held by the 2 dp replicas.

limits: meshes of at most 2**20 devices, device ids at most 2**31-1, dims below 2**62;
  a plan of more than planner.MAX_PLAN_TRANSFERS transfers or MAX_PLAN_CHUNKS chunks is
  refused from the layouts (exit 2) before planning.

exit status: 0 ok; 2 bad input or a plan over the limits (one line on stderr)."""

JOBS_STATUS_USAGE = ("JAX_M2N_TOKEN=... python -m jax_m2n jobs status HOST:PORT "
                     "[--token-file PATH] [--timeout S] [--json]")
JOBS_STATUS_EPILOG = """token: from --token-file PATH (its content, surrounding whitespace
  dropped), else the environment variable JAX_M2N_TOKEN; never an argument (argv is
  public).

exit status: 0 ok; 1 no answer (nothing listens, or the publisher stalled); 2 bad
  input (usage, no token, a malformed address, a wrong token), one line on stderr."""

# Bandwidths outside this range are typos (and 1e-320 GB/s would price a byte at
# infinity, which JSON cannot carry).
MIN_GBPS, MAX_GBPS = 1e-3, 1e6


class _UsageError(Exception):
  pass


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, exit status 2 (raised to main)
    raise _UsageError(message)


def _parse_shape(text: str) -> tuple[int, ...]:
  text = text.strip()
  if text in ("", "()", "scalar"):
    return ()
  try:
    shape = tuple(int(s) for s in text.strip("()[] ").split(",") if s.strip())
  except ValueError:
    raise ReshardError(f"plan: --shape must be comma-separated ints; got {text!r}.")
  if any(s < 0 for s in shape):
    raise ReshardError(f"plan: --shape dims must be >= 0; got {text!r}.")
  check_shape(shape, "plan: --shape")
  return shape


def _parse_dtype(name: str) -> np.dtype:
  import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)
  try:
    dtype = np.dtype(getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else name)
  except TypeError:
    raise ReshardError(f"plan: --dtype must name a numpy/JAX dtype; got {name!r}.")
  if dtype.kind not in "biufcV" or dtype.itemsize == 0:
    raise ReshardError(f"plan: --dtype must name a numeric dtype; got {name!r}.")
  return dtype


def _number(name: str, kind: type, minimum: float, maximum: float = MAX_DIM):
  """An argparse type: an int in [minimum, maximum], or a float > `minimum` (or in
  [minimum, maximum] when a maximum is given)."""
  def parse(text):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"{name} must be {'an int' if kind is int else 'a number'}; got {text!r}")
    if kind is float and maximum != MAX_DIM:
      if not minimum <= value <= maximum:
        raise argparse.ArgumentTypeError(
            f"{name} must lie in [{minimum:g}, {maximum:g}]; got {text!r}")
    elif kind is float and not value > minimum:
      raise argparse.ArgumentTypeError(f"{name} must be > {minimum:g}; got {text!r}")
    if kind is int and not minimum <= value <= maximum:
      raise argparse.ArgumentTypeError(
          f"{name} must lie in [{minimum}, {maximum}]; got {text!r}")
    return value
  return parse


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="python -m jax_m2n", description="jax_m2n command line.")
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  p = sub.add_parser("plan", usage=USAGE,
                     help="plan a reshard between two compact layouts and price it",
                     description="Plans a reshard between two device-free layouts and "
                     "prices every route with the cost model (no devices needed).",
                     epilog=GRAMMAR, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shape", required=True, help="global shape, e.g. 4,8")
  p.add_argument("--dtype", default="float32", help="element type, e.g. bfloat16")
  p.add_argument("--src", required=True, help='e.g. "mesh(dp=1, tp=4) P(tp, None) @0"')
  p.add_argument("--dst", required=True, help='e.g. "mesh(dp=2, tp=2) P(tp, None) @4"')
  p.add_argument("--domain-size", type=_number("--domain-size", int, 1), default=8,
                 help="device ids [k*N, (k+1)*N) form NVLink domain k (default 8)")
  p.add_argument("--nic-gbps", type=_number("--nic-gbps", float, MIN_GBPS, MAX_GBPS),
                 default=DEFAULT_NIC_GBPS,
                 help="per-device network bandwidth, one direction, GB/s (default 50; "
                 f"{MIN_GBPS:g} to {MAX_GBPS:g})")
  p.add_argument("--nvlink-gbps", type=_number("--nvlink-gbps", float, MIN_GBPS, MAX_GBPS),
                 default=DEFAULT_NVLINK_GBPS,
                 help="per-device NVLink bandwidth, one direction, GB/s (default 450; "
                 f"{MIN_GBPS:g} to {MAX_GBPS:g})")
  p.add_argument("--route", choices=ROUTES, default="hierarchical")
  p.add_argument("--chunk-bytes", type=_number("--chunk-bytes", int, 1),
                 default=None, help="bound on one pipelined chunk (default: chosen per "
                 "plan from its bytes and forwarding hops, as reshard does)")
  p.add_argument("--transport", choices=TRANSPORTS, default=DEFAULT_TRANSPORT,
                 help="the transport whose per-call, per-step and per-chunk costs the "
                 f"estimates count and the default chunking uses (default "
                 f"{DEFAULT_TRANSPORT}, as jax_m2n.plan() on CPU devices; cuda prices "
                 "GPUs, as jax_m2n.plan() on GPU devices)")
  p.add_argument("--json", action="store_true",
                 help="one strict JSON object on stdout (a non-finite number is null)")
  p.add_argument("-v", "--verbose", action="store_true",
                 help="debug log of the logger 'jax_m2n' on stderr (what was planned)")
  jobs = sub.add_parser("jobs", help="weight sync between separate jobs "
                        "(Publisher / Subscriber)").add_subparsers(
      dest="jobs_command", metavar="status", required=True, parser_class=_Parser)
  s = jobs.add_parser("status", usage=JOBS_STATUS_USAGE, allow_abbrev=False,
                      help="ask a running Publisher how it is",
                      description="Asks a running Publisher (its process 0) for its "
                      "versions, subscribers, counts and relays, over its control "
                      "channel (authenticated as a Subscriber is; no data moves).",
                      epilog=JOBS_STATUS_EPILOG,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
  s.add_argument("address", help="the Publisher's address, host:port")
  s.add_argument("--token-file", metavar="PATH",
                 help="a file holding the token (else $JAX_M2N_TOKEN)")
  s.add_argument("--timeout", type=_number("--timeout", float, 0.0), default=10.0,
                 metavar="S",
                 help="seconds to wait for the handshake and the answer (default 10)")
  s.add_argument("--json", action="store_true",
                 help="the answer as one JSON object on stdout")
  return parser


def _finite(value):
  """JSON has no Infinity/NaN: non-finite floats become null (documented in --json)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  return value


def plan_json(plan, dtype: np.dtype) -> dict:
  """The `plan --json` object (the contract outside checks use). Strict JSON: a
  non-finite estimate (none within the CLI's bandwidth range) would be null."""
  itemsize = plan.itemsizes
  traffic = plan.traffic
  return {
      "version": 1,
      "shape": list(plan.tensors[0].src.shape),
      "dtype": dtype.name,
      "payload_bytes": plan.payload_bytes,
      "route": plan.route,
      "transfers": [{
          "src": x.src, "dst": x.dst, "stage": x.stage,
          "box": [[lo, hi] for lo, hi in x.box],
          "bytes": box_size(x.box) * itemsize[x.tensor],
      } for x in plan.transfers],
      "bytes_by_link": plan.bytes_by_link,
      "estimate_ms": _finite(dict(plan.estimate_ms)),
      "route_estimate_ms": _finite({r: plan.with_route(r).route_estimate_ms()
                                    for r in ROUTES}),
      "sol_ms": _finite(plan.sol_ms),
      "chunk_bytes": plan.chunk_bytes,
      "chunks": len(plan.chunks),
      "steps": plan.chunks.n_steps,
      "devices": {str(d): {
          "egress": traffic.egress.get(d, {"nvlink": 0, "network": 0}),
          "ingress": traffic.ingress.get(d, {"nvlink": 0, "network": 0}),
      } for d in plan.devices},
      "topology": {"domain_size": plan.topology.domain_size,
                   "nvlink_gbps": plan.topology.nvlink_gbps,
                   "nic_gbps": plan.topology.nic_gbps},
  }


def _plan_command(args) -> int:
  shape = _parse_shape(args.shape)
  dtype = _parse_dtype(args.dtype)
  src = parse_mesh_spec(args.src).layout(shape)
  dst = parse_mesh_spec(args.dst).layout(shape)
  topo = Topology(domain_size=args.domain_size, nvlink_gbps=args.nvlink_gbps,
                  nic_gbps=args.nic_gbps)
  # Every route is planned (the estimates compare them): refuse before any of them.
  for route in ROUTES:
    check_plan_size([src], [dst], [dtype.itemsize], route,
                    args.chunk_bytes if route == args.route else None)
  plan = plan_reshard([src], [dst], [dtype.itemsize], topo, args.route,
                      Chunking(args.transport, args.chunk_bytes))
  if args.json:
    sys.stdout.write(json.dumps(plan_json(plan, dtype), allow_nan=False))
    sys.stdout.write("\n")
    return 0
  print(f"reshard {shape} {dtype.name}: {parse_mesh_spec(args.src)} -> "
        f"{parse_mesh_spec(args.dst)}")
  print(plan.summary())
  print("transfers (before chunking):")
  for x in plan.transfers:
    box = "[" + ", ".join(f"{lo}:{hi}" for lo, hi in x.box) + "]"
    print(f"  {x.stage:>7} {x.src:>5} -> {x.dst:<5} {box} "
          f"{box_size(x.box) * dtype.itemsize} B ({topo.link_class(x.src, x.dst)})")
  return 0


def _token(args) -> str:
  if args.token_file is not None:
    try:
      with open(args.token_file) as f:
        return f.read().strip()
    except OSError as e:
      raise ReshardError(f"jobs status: --token-file must be a readable file; got "
                         f"{args.token_file!r} ({e.strerror}).") from None
  token = os.environ.get("JAX_M2N_TOKEN")
  if not token:
    raise ReshardError("jobs status: the token must come from $JAX_M2N_TOKEN or "
                       "--token-file PATH (never the command line); got neither.")
  return token


def _jobs_command(args) -> int:
  try:
    reply = jobs_status.ask(args.address, _token(args), args.timeout)
  except ReshardRuntimeError as e:  # no answer: not the caller's input
    print(f"jax_m2n: error: {e}", file=sys.stderr)
    return 1
  if args.json:
    sys.stdout.write(json.dumps(reply, allow_nan=False) + "\n")
  else:
    print(jobs_status.summary(reply))
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit status (2 for bad input)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  if argv in ([], ["plan"]):  # called bare: the usage, as argparse does for no arguments
    sys.stderr.write("usage: " + USAGE + "\n\n" + GRAMMAR + "\n\n"
                     "`python -m jax_m2n plan --help` for every option.\n")
    return 2
  try:
    args = parser.parse_args(argv)
    if args.command == "plan":
      if args.verbose:
        _debug_log()
      # Millions of small tuples and no cycles: the collector would rescan them many
      # times over (a third of a 1,000 x 1,000-device run).
      gc.disable()
      return _plan_command(args)
    if args.command == "jobs":
      return _jobs_command(args)
  except _UsageError as e:
    print(f"jax_m2n: error: {e}", file=sys.stderr)
    return 2
  except ReshardError as e:
    print(f"jax_m2n: error: {e}", file=sys.stderr)
    return 2
  except MemoryError:
    print("jax_m2n: error: plan: out of memory; use a smaller shape, fewer devices or a "
          "larger --chunk-bytes.", file=sys.stderr)
    return 2
  return 2


def _debug_log() -> None:
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
  log = logging.getLogger("jax_m2n")
  log.addHandler(handler)
  log.setLevel(logging.DEBUG)
