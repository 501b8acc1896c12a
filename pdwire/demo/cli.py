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
from typing import Any

from pdwire.demo.spec import Capacity, ModelSpec, capacity_for

# exit statuses (docs/cli.md)
EXIT_OK, EXIT_VERIFY_FAILED, EXIT_USAGE, EXIT_NOT_RUN, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

EPILOG = """exit status: 0 every request verified; 1 a request failed or a byte differed (verification);
2 a bad argument, a missing extra or an unavailable backend (nothing was started); 3 the demo could
not run (a rank crashed, the handshake was refused, a start-up timed out); 130 interrupted (Ctrl-C:
every rank stopped, every shared-memory file removed)."""


# dest -> (flag, type, default, lowest, highest, help without the default)
OPTIONS: dict[str, tuple[str, type, float, float, float, str]] = {
    "prefill_tp": ("--prefill-tp", int, 2, 1, 64, "prefill TP size, 1..64"),
    "decode_tp": ("--decode-tp", int, 4, 1, 64, "decode TP size, 1..64"),
    "requests": ("--requests", int, 24, 1, 4096, "concurrent requests, 1..4096"),
    "min_tokens": ("--min-tokens", int, 32, 1, 65535, "shortest prompt in tokens, 1..65535"),
    "max_tokens": ("--max-tokens", int, 512, 1, 65535, "longest prompt, min-tokens..65535"),
    "layers": ("--layers", int, 4, 1, 256, "attention layers, 1..256"),
    "heads": ("--heads", int, 8, 1, 1024, "KV heads, divisible by both TP sizes; ignored with --mla"),
    "head_dim": ("--head-dim", int, 64, 1, 4096, "head dimension, 1..4096"),
    "page_size": ("--page-size", int, 16, 1, 4096, "tokens per KV page, 1..4096"),
    "chunk_pages": ("--chunk-pages", int, 8, 1, 65535, "pages per chunked-prefill chunk"),
    "seed": ("--seed", int, 1, 0, 2**32 - 1, "seed of prompt lengths and content"),
    "timeout": ("--timeout", float, 60.0, 0.1, 86400, "per-room timeout in seconds, > 0"),
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
    for dest, (flag, kind, default, _, _, text) in OPTIONS.items():
        p.add_argument(
            flag, dest=dest, type=kind, default=kind(default), help=f"{text} (default: %(default)s)"
        )
    p.add_argument(
        "--backend",
        default=None,
        choices=known_backends(),
        help="transfer engine (default: nixl when it imports, else local)",
    )
    p.add_argument("--mla", action="store_true", help="MLA model (latent KV, SWA + DSA indexer state)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object on stdout")
    p.add_argument(
        "--serve",
        action="store_true",
        help="the deployment's shape: etcd plus a `pdwire serve prefill` and a `pdwire serve decode` process",
    )
    p.set_defaults(func=run)


def validate(args: argparse.Namespace) -> str | None:
    """The first argument that cannot work, as one line naming it and its allowed range."""
    for dest, (flag, _, _, lo, hi, _) in OPTIONS.items():
        if not lo <= (value := getattr(args, dest)) <= hi:
            return f"{flag} {value:g}: must be {lo:g}..{hi:g}"
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
    cap = capacity_for(spec, [args.max_tokens] * args.requests)
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
