"""``pdwire demo``: a prefill group and a decode group as processes, N requests end to end.

Each rank holds a small hybrid model's caches (attention KV, Mamba conv with q|k|v
sub-blocks and temporal state, SWA; or MLA with SWA and DSA indexer) in memory allocated
through the chosen backend. Prefill ranks fill their TP shards of deterministic per-request
tensors; every request goes through the whole protocol (Hello, RegisterInfo, TransferRequest,
chunked KV writes, state and aux on the last chunk, completion accounting); every decode rank
then checks its destination slots byte for byte against shards derived independently from the
full tensors, and at the end that no byte outside a destination slot changed.

This module only builds the parser and checks the arguments (no torch, no engine: ``--help``
and a refused argument answer at once); :mod:`.run` runs the demo.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any

from pdwire.demo.spec import Capacity, ModelSpec, pages_for

# exit statuses (docs/cli.md)
EXIT_OK, EXIT_VERIFY_FAILED, EXIT_USAGE, EXIT_NOT_RUN, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

EPILOG = """exit status: 0 every request verified; 1 a request failed or a byte differed (verification);
2 a bad argument, a missing extra or an unavailable backend (nothing was started); 3 the demo could
not run (a rank crashed, the handshake was refused, a start-up timed out); 130 interrupted (Ctrl-C:
every rank stopped, every shared-memory file removed)."""


@dataclass(frozen=True)
class Bound:
    """An integer (or float) argument's allowed range, inclusive."""

    flag: str
    lo: float
    hi: float

    def problem(self, value: float) -> str | None:
        if self.lo <= value <= self.hi:
            return None
        lo, hi = (f"{self.lo:g}", f"{self.hi:g}")
        return f"{self.flag} {value:g}: must be {lo}..{hi}"


BOUNDS: dict[str, Bound] = {
    "prefill_tp": Bound("--prefill-tp", 1, 64),
    "decode_tp": Bound("--decode-tp", 1, 64),
    "requests": Bound("--requests", 1, 4096),
    "min_tokens": Bound("--min-tokens", 1, 65535),
    "max_tokens": Bound("--max-tokens", 1, 65535),
    "layers": Bound("--layers", 1, 256),
    "heads": Bound("--heads", 1, 1024),
    "head_dim": Bound("--head-dim", 1, 4096),
    "page_size": Bound("--page-size", 1, 4096),
    "chunk_pages": Bound("--chunk-pages", 1, 65535),
    "seed": Bound("--seed", 0, 2**32 - 1),
    "timeout": Bound("--timeout", 0.1, 86400),
}
MAX_BYTES_PER_RANK = 8 << 30  # a rank's caches must fit in memory: refuse shapes that cannot


def register(subparsers: Any) -> None:
    from pdwire.demo import register_mori_fake
    from pdwire.runtime.backends.registry import known_backends

    register_mori_fake()
    p = subparsers.add_parser(
        "demo",
        help="prefill and decode groups as processes; move and verify N requests",
        description=__doc__.split("\n\nThis module")[0] if __doc__ else None,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prefill-tp", type=int, default=2, help="prefill TP size, 1..64 (default: %(default)s)")
    p.add_argument("--decode-tp", type=int, default=4, help="decode TP size, 1..64 (default: %(default)s)")
    p.add_argument(
        "--backend",
        default=None,
        choices=known_backends(),
        help="transfer engine (default: nixl when it imports, else local)",
    )
    p.add_argument(
        "--requests", type=int, default=24, help="concurrent requests, 1..4096 (default: %(default)s)"
    )
    p.add_argument(
        "--min-tokens",
        type=int,
        default=32,
        help="shortest prompt in tokens, 1..65535 (default: %(default)s)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=512, help="longest prompt, min-tokens..65535 (default: %(default)s)"
    )
    p.add_argument("--layers", type=int, default=4, help="attention layers, 1..256 (default: %(default)s)")
    p.add_argument(
        "--heads", type=int, default=8,
        help="KV heads, divisible by both TP sizes; ignored with --mla (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--head-dim", type=int, default=64, help="head dimension, 1..4096 (default: %(default)s)")
    p.add_argument(
        "--page-size", type=int, default=16, help="tokens per KV page, 1..4096 (default: %(default)s)"
    )
    p.add_argument(
        "--chunk-pages", type=int, default=8, help="pages per chunked-prefill chunk (default: %(default)s)"
    )
    p.add_argument("--mla", action="store_true", help="MLA model (latent KV, SWA + DSA indexer state)")
    p.add_argument(
        "--seed", type=int, default=1, help="seed of prompt lengths and content (default: %(default)s)"
    )
    p.add_argument(
        "--timeout", type=float, default=60.0, help="per-room timeout in seconds, > 0 (default: %(default)s)"
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object on stdout")
    p.add_argument(
        "--serve",
        action="store_true",
        help="the deployment's shape: etcd plus a `pdwire serve prefill` and a `pdwire serve decode` process",
    )
    p.set_defaults(func=run)


def validate(args: argparse.Namespace) -> str | None:
    """The first argument that cannot work, as one line naming it and its allowed range."""
    for dest, bound in BOUNDS.items():
        problem = bound.problem(getattr(args, dest))
        if problem is not None:
            return problem
    if args.json and args.serve:
        return "--json: not with --serve (that mode reports the serve processes' outcome as text)"
    if args.max_tokens < args.min_tokens:
        return f"--max-tokens {args.max_tokens}: must be --min-tokens ({args.min_tokens})..65535"
    spec = spec_of(args)
    for flag, tp in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        try:
            spec.check_tp(tp)
        except ValueError:
            if not spec.mla and spec.kv_heads % tp:
                return f"{flag} {tp}: must divide --heads ({spec.kv_heads})"
            return f"{flag} {tp}: must divide the model's sharded sizes {_sharded(spec)}"
    # the largest pools one rank could need (every request at --max-tokens)
    pages, swa = pages_for(spec, args.max_tokens)
    cap = Capacity(args.requests * pages + 8, args.requests + 2, args.requests * swa + 8, args.requests + 2)
    need = _bytes_upper_bound(spec, cap, min(args.prefill_tp, args.decode_tp))
    if need > MAX_BYTES_PER_RANK:
        return (
            f"--requests {args.requests} x --max-tokens {args.max_tokens}: about {need / 2**30:.1f} GiB per "
            f"rank, more than {MAX_BYTES_PER_RANK >> 30} GiB; lower one of them"
        )
    return None


def spec_of(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(
        layers=args.layers,
        kv_heads=args.heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        mla=args.mla,
    )


def _sharded(spec: ModelSpec) -> str:
    return ", ".join(str(s) for s in (spec.kv_heads, *spec.conv_blocks, spec.ssm_heads))


def _bytes_upper_bound(spec: ModelSpec, cap: Capacity, tp: int) -> int:
    """Bytes of one rank's caches at TP ``tp`` (an upper bound: state and aux counted generously)."""
    per_token = 2 * spec.layers * (spec.latent_dim if spec.mla else 2 * spec.kv_heads * spec.head_dim // tp)
    swa = 2 * spec.swa_layers * (spec.latent_dim if spec.mla else 2 * spec.kv_heads * spec.head_dim // tp)
    return per_token * cap.pages * spec.page_size + swa * cap.swa_pages * spec.page_size + (1 << 20)


def _importable(name: str) -> bool:
    """Whether ``name`` can be found, without importing it (torch takes seconds)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def run(args: argparse.Namespace) -> int:
    problem = validate(args)
    if problem is not None:
        print(f"pdwire demo: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if not _importable("torch"):
        # the command's one line naming the extra (pdwire.cli.missing_extra), exit status 2
        raise ModuleNotFoundError("No module named 'torch'", name="torch")
    from pdwire.runtime.backends.registry import backend_problem, default_backend

    backend = args.backend or default_backend()
    problem = backend_problem(backend)
    if problem is not None:
        print(f"pdwire demo: --backend {backend}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.serve:
        from pdwire.demo.serve_mode import run_serve_demo

        return run_serve_demo(args, backend, spec_of(args))
    from pdwire.demo.run import run_demo

    return run_demo(args, backend, spec_of(args))
