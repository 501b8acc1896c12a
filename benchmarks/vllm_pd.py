"""Prefill/decode with real vLLM engines: PdwireConnector against vLLM's NixlConnector (pull) and
NixlPushConnector (push), same prompts, same run.

    .venv-vllm/bin/python benchmarks/vllm_pd.py [--requests 8] [--prompt-len 400] [--repeats 3]
        [--model dense|hybrid] [--connectors pdwire,nixl-pull,nixl-push]

Each connector gets its own prefill and decode engine (vLLM's CPU build, a tiny random model
written here, block size 32, each engine bound to one core); all engines start together. Per
connector: one warm-up round (handshakes), then ``--repeats`` rounds, each sending every prompt
to prefill (one token) and then, all at once, to decode, as the proxy does. The connectors take
turns round by round, so all see the same machine load. Reported (medians over all requests of
all rounds):

* **decode TTFT**: decode request added -> its first token (load wait + the first decode step).
* **transfer**: the time data moved per request: pdwire's first post -> last completion on
  prefill; NIXL's own ``vllm:nixl_xfer_time_seconds`` (per transfer) where vLLM reports it.
* **bytes / descriptors per request**: what pdwire posted (its counters); NIXL's
  ``vllm:nixl_bytes_transferred`` / ``vllm:nixl_num_descriptors`` where reported.
* tokens equal to the first connector's, and decode's ``external_kv_transfer`` prompt tokens.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from _common import arguments, load, machine, table_row

from pdwire.runtime.control_auth import ENV_KEYS, generate_directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the engine harness is test tooling
from tests.vllm import harness as h
from tests.vllm import tiny_models as tm

CONNECTORS = {
    "pdwire": {"kv_connector": "PdwireConnector", "kv_connector_module_path": "pdwire.integrations.vllm"},
    "nixl-pull": {"kv_connector": "NixlConnector"},
    "nixl-push": {"kv_connector": "NixlPushConnector"},
}


def _hist(metrics: Mapping[str, float], name: str) -> tuple[float, float]:
    s = sum(v for k, v in metrics.items() if k.startswith(f"{name}_sum{{"))
    c = sum(v for k, v in metrics.items() if k.startswith(f"{name}_count{{"))
    return s, c


def _median(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    return f"{statistics.median(values) * scale:,.{digits}f}" if values else "n/a"


def main() -> int:
    ap = arguments(__doc__)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", choices=tm.MODELS, default=tm.DENSE)
    ap.add_argument("--connectors", default=",".join(CONNECTORS))
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()
    names = [c for c in args.connectors.split(",") if c]
    for c in names:
        if c not in CONNECTORS:
            ap.error(f"unknown connector {c!r}; known: {', '.join(CONNECTORS)}")
    work = Path(tempfile.mkdtemp(prefix="vllm-pd-bench-"))
    model = str(tm.write_model(args.model, work / args.model))
    hybrid = args.model == tm.HYBRID
    # pdwire's control plane authenticated as in a deployment: one key directory for every engine
    keys = work / "control-keys"
    generate_directory(keys)
    base_env = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN", ENV_KEYS: str(keys)}
    specs = []
    for i, c in enumerate(names):
        for role, cpu in (("kv_producer", "0"), ("kv_consumer", "1")):
            env = dict(
                base_env,
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(
                    27000 + (os.getpid() % 100) * 10 + 2 * i + (role == "kv_consumer")
                ),
            )
            specs.append(
                h.EngineSpec(
                    model,
                    f"{c}-{'prefill' if role == 'kv_producer' else 'decode'}",
                    cpus=cpu,
                    kv_transfer_config={**CONNECTORS[c], "kv_role": role},
                    env=env,
                    block_size=None if hybrid else 32,
                    max_num_seqs=1 if hybrid else max(8, args.requests),
                    max_model_len=max(512, args.prompt_len + args.max_tokens + 32),
                    kv_blocks=4096,
                )
            )
    t0 = time.monotonic()
    engines = h.start_engines(specs, work / "logs")
    startup = time.monotonic() - t0
    pairs = {c: (engines[2 * i], engines[2 * i + 1]) for i, c in enumerate(names)}
    rows: dict[str, dict[str, list[float]]] = {
        c: {"ttft": [], "xfer": [], "bytes": [], "descs": []} for c in names
    }
    tokens: dict[str, dict[str, list[int]]] = {}
    loaded = dict.fromkeys(names, 0.0)
    try:
        for rnd in range(args.repeats + 1):  # round 0 warms up (handshakes, first allocations)
            prompts = h.random_prompts(args.requests, args.prompt_len, seed=1000 + rnd, prefix=f"r{rnd}")
            for c in names:
                pre, dec = pairs[c]
                before_p, before_d = pre.metrics(), dec.metrics()
                stats_before = pre.connector_stats() if c.startswith("pdwire") else {}
                _, res = h.run_pd(pre, dec, prompts, args.max_tokens, timeout_s=600)
                if rnd == 0:
                    continue
                after_p, after_d = pre.metrics(), dec.metrics()
                r = rows[c]
                r["ttft"] += [x.ttft_s for x in res.values() if x.ttft_s is not None]
                tokens.setdefault(c, {}).update(h.tokens(res))
                loaded[c] += h.external_prompt_tokens(after_d) - h.external_prompt_tokens(before_d)
                if c.startswith("pdwire"):
                    st = pre.connector_stats()
                    spans = [v for k, v in st["spans"].items() if k not in stats_before.get("spans", {})]
                    r["xfer"] += [b - a for a, b in spans]
                    n = len(prompts)
                    r["bytes"].append((st["bytes_posted"] - stats_before.get("bytes_posted", 0)) / n)
                    r["descs"].append((st["descriptors"] - stats_before.get("descriptors", 0)) / n)
                else:
                    side = after_d if c == "nixl-pull" else after_p  # the side that posts the transfers
                    base = before_d if c == "nixl-pull" else before_p
                    for key, name in (
                        ("xfer", "vllm:nixl_xfer_time_seconds"),
                        ("bytes", "vllm:nixl_bytes_transferred"),
                        ("descs", "vllm:nixl_num_descriptors"),
                    ):
                        (s1, c1), (s0, c0) = _hist(side, name), _hist(base, name)
                        if c1 > c0:  # transfer time per transfer, bytes and descriptors per request
                            r[key].append((s1 - s0) / ((c1 - c0) if key == "xfer" else len(prompts)))
    finally:
        for e in engines:
            e.close()
    first = names[0]
    print(machine(load()))
    print(
        f"model: tiny {args.model}; {args.requests} requests x {args.prompt_len} prompt tokens, "
        f"{args.max_tokens} output tokens; {args.repeats} rounds (+1 warm-up); engines up in {startup:.0f}s"
    )
    print()
    print(
        "| connector | decode TTFT ms (median) | transfer ms (median) | bytes / request "
        f"| descriptors / request | tokens = {first} | external prompt tokens |\n"
        "|---|---|---|---|---|---|---|"
    )
    for c in names:
        r = rows[c]
        same = "yes" if tokens.get(c) == tokens.get(first) else "NO"
        expect = args.requests * args.repeats * (args.prompt_len - (1 if hybrid else 0))
        cells = [_median(r["ttft"], 1000), _median(r["xfer"], 1000, 2), _median(r["bytes"], 1, 0)]
        print(table_row([c, *cells, _median(r["descs"], 1, 0), same, f"{loaded[c]:.0f} / {expect}"]))
    if not args.keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"\nlogs: {work / 'logs'}")
    bad = [c for c in names if tokens.get(c) != tokens.get(first)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
