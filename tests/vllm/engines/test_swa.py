"""Sliding-window attention through PdwireConnector: a tiny Gemma3 (two sliding-window layers of
a 64-token window, one full-attention layer) that vLLM runs with the hybrid allocator, one KV
cache group per layer, prefill TP 1 -> decode TP 1 and 2, prefill TP 2 -> decode TP 1; and the
same model with sliding-window layers only (the first window group's live pages are the KV page
list). Tokens equal one engine's, and the prefill moved only the blocks in the window (its bytes
sent against the blocks a whole-prompt copy would move). The spec-level cases use vLLM's real
cache specs and cache managers, no engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.vllm import harness as h
from tests.vllm import tiny_models as tm
from tests.vllm.engines.conftest import MAX_TOKENS, PDWIRE_ENV, kv_usage, pdwire_config, settle, start

pytestmark = [pytest.mark.vllm]

W, BS = tm.SLIDING_WINDOW, 32
# prefill computes all but the last token (n = length - 1): n = 191 ends its window exactly on a
# block boundary (191 - 64 + 1 = 128), n = 199 inside a block, n = 39 is shorter than the window
LENGTHS = (192, 200, 40)
BLOCK_BYTES = 2 * BS * 2 * 64 * 4  # one block of one layer: 2 heads x 32 tokens x K|V x 64 x fp32


def _live(n: int) -> int:
    """Blocks of a sliding-window layer a request of n computed tokens still needs."""
    return math.ceil(n / BS) - max(0, n - W + 1) // BS


# ---------------------------------------------------------------------- vLLM's real specs


def _spec(kind: str, **kw: Any) -> Any:
    from vllm.v1 import kv_cache_interface as k

    common = dict(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    if kind == "full":
        return k.FullAttentionSpec(**common)
    if kind == "sliding":
        return k.SlidingWindowSpec(**common, sliding_window=kw.get("window", W))
    if kind == "chunked":
        return k.ChunkedLocalAttentionSpec(**common, attention_chunk_size=kw.get("chunk", 128))
    if kind == "sliding-mla":
        return k.SlidingWindowMLASpec(
            block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.float32, sliding_window=W
        )
    if kind == "mamba":
        return k.MambaSpec(block_size=BS, shapes=((3, 64), (4, 8, 16)), dtypes=(torch.float32, torch.float32))
    raise ValueError(kind)


@pytest.fixture
def cpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers' attention backend, which vLLM reads from a built model: CPU_ATTN's blocks."""
    from pdwire.integrations.vllm import memory

    monkeypatch.setattr(memory, "_kv_per_token", lambda vllm_config, layers: False)


def _config(*kinds: str) -> tuple[Any, Any]:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [
        KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], _spec(kind)) for i, kind in enumerate(kinds)
    ]
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    hf = SimpleNamespace(mamba_n_groups=1, mamba_n_heads=4, mamba_d_state=16)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2, hf_text_config=hf),
        cache_config=SimpleNamespace(block_size=BS),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return vllm_config, kv_cache_config


def test_window_groups_from_vllms_specs_and_their_live_blocks(cpu_backend: None) -> None:
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager, SlidingWindowManager

    from pdwire.integrations.vllm.memory import MambaGroup, WindowGroup, vllm_groups

    groups = vllm_groups(*_config("sliding", "full", "chunked", "mamba"))
    sliding, _, chunked, mamba = groups
    assert isinstance(sliding, WindowGroup) and isinstance(chunked, WindowGroup)
    assert (sliding.sliding_window, sliding.kind, chunked.chunk, chunked.kind) == (
        W, "sliding-window", 128, "chunked-local",
    )  # fmt: skip
    assert isinstance(mamba, MambaGroup)
    a = sliding.attention
    assert (a.num_kv_heads, a.head_size, a.dtype_bytes, a.total_kv_heads) == (2, 64, 4, 2)
    # the blocks vLLM frees on prefill (and leaves null on decode) are exactly those before the window
    sw = SimpleNamespace(sliding_window=W, extra_retained_tokens=0)
    cl = SimpleNamespace(attention_chunk_size=128)
    for n in range(1, 400):
        assert sliding.skipped_tokens(n) == SlidingWindowManager.get_num_skipped_tokens(sw, n)  # type: ignore[arg-type]
        assert chunked.skipped_tokens(n) == ChunkedLocalAttentionManager.get_num_skipped_tokens(cl, n)  # type: ignore[arg-type]
        assert len(sliding.live_pages(n)) == _live(n)
    assert list(sliding.live_pages(191)) == [4, 5] and list(chunked.live_pages(256)) == []


def test_scheduler_split_moves_window_blocks_at_the_same_positions(cpu_backend: None) -> None:
    from pdwire.integrations.vllm.connector import _Groups

    vllm_config, kv_cache_config = _config("sliding", "full", "sliding")
    groups = _Groups(vllm_config, kv_cache_config)
    assert groups.kv == 1 and groups.state == [0, 2] and not groups.unsupported
    n = 199
    table = [0] * 4 + [11, 12, 13]  # vLLM's null block (0) before the window
    pages, state = groups.split((table, list(range(20, 27)), [0] * 4 + [31, 32, 33]), n)
    assert pages == list(range(20, 27)) and state == [[11, 12, 13], [31, 32, 33]]
    assert groups.problem(pages, state, n) is None
    assert groups.problem(pages, [[0, 12, 13], [31, 32, 33]], n) is not None  # a freed block
    assert groups.problem(pages, [[12, 13], [31, 32, 33]], n) is not None  # a block short
    assert groups.first_live_page(n) == 4


def test_window_full_and_mamba_groups_split_in_component_order(cpu_backend: None) -> None:
    from pdwire.integrations.vllm.connector import _Groups

    groups = _Groups(*_config("sliding", "full", "mamba"))
    assert groups.kv == 1 and groups.state == [0, 2]
    n = 199  # the window's blocks 4..6, the full group's 0..6, Mamba's running-state slot
    pages, state = groups.split(([0] * 4 + [11, 12, 13], list(range(20, 27)), [0, 0, 0, 0, 0, 0, 41]), n)
    assert pages == list(range(20, 27)) and state == [[11, 12, 13], [41]]
    assert groups.problem(pages, state, n) is None


def test_a_model_of_window_groups_only_sends_its_live_pages_as_the_kv_list(cpu_backend: None) -> None:
    from pdwire.integrations.vllm.connector import _Groups

    groups = _Groups(*_config("sliding", "sliding"))
    assert groups.kv == 0 and groups.state == [1]
    pages, state = groups.split(([0, 0, 0, 0, 5, 6, 7], [0, 0, 0, 0, 8, 9, 10]), 199)
    assert pages == [5, 6, 7] and state == [[8, 9, 10]]


def test_refusals_name_the_kind(cpu_backend: None) -> None:
    from pdwire.integrations.vllm.connector import _Groups
    from pdwire.integrations.vllm.memory import LayoutError, vllm_groups

    with pytest.raises(LayoutError, match=r"SlidingWindowMLASpec.*sliding-window MLA"):
        vllm_groups(*_config("full", "sliding-mla"))
    two_full = _Groups(*_config("full", "sliding", "full"))
    assert two_full.extra_full == [2]


# ---------------------------------------------------------------------- real engines


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, engine_logs: Path) -> Iterator[dict[str, h.Engine]]:
    """Every engine of the module, started together: the mixed model (sliding + full) on one
    engine, as prefill TP 1 and 2 and as decode TP 1 and 2; the sliding-only model on one engine,
    as prefill and as decode."""
    base = tmp_path_factory.mktemp("models")
    mixed = str(tm.write_sliding_gemma3(base / "sliding"))
    alone = str(tm.write_sliding_gemma3(base / "sliding-only", full=False))

    def spec(
        model: str, name: str, role: str | None = None, tp: int = 1, cpus: str = "0", cache: bool = False
    ) -> h.EngineSpec:
        kv = None if role is None else pdwire_config(role)
        return h.EngineSpec(
            model, name, tp=tp, cpus="0|1" if tp == 2 else cpus, kv_blocks=256, kv_transfer_config=kv,
            env=PDWIRE_ENV if role else {}, enable_prefix_caching=cache,
        )  # fmt: skip

    specs = {
        "single": spec(mixed, "swa-single"),
        "prefill": spec(mixed, "swa-prefill", "kv_producer"),
        "prefill-tp2": spec(mixed, "swa-prefill-tp2", "kv_producer", tp=2),
        "decode": spec(mixed, "swa-decode", "kv_consumer", cpus="1"),
        "decode-tp2": spec(mixed, "swa-decode-tp2", "kv_consumer", tp=2),
        "decode-cached": spec(mixed, "swa-decode-cached", "kv_consumer", cpus="1", cache=True),
        "alone-single": spec(alone, "swa-only-single", cpus="1"),
        "alone-prefill": spec(alone, "swa-only-prefill", "kv_producer"),
        "alone-decode": spec(alone, "swa-only-decode", "kv_consumer", cpus="1"),
    }
    started = start(list(specs.values()), engine_logs)
    try:
        yield dict(zip(specs, started, strict=True))
    finally:
        for e in started:
            e.close()


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, length in enumerate(LENGTHS):
        out.update(h.random_prompts(1, length, seed=30 + i, prefix=f"swa{length}"))
    return out


def _pd(
    engines: dict[str, h.Engine], prefix: str, prefill: str, decode: str, prompts: dict[str, list[int]]
) -> dict[str, int]:
    """Prompts through prefill then decode; tokens must equal one engine's. Returns the prefill
    rank's byte count for the run (0 when its worker runs in another process, TP 2)."""
    p, d = engines[prefill], engines[decode]
    expected = h.tokens(h.run_single(engines[f"{prefix}single"], prompts, MAX_TOKENS))
    assert len({tuple(t) for t in expected.values()}) == len(prompts)  # the model's output varies
    before, decode_before = p.connector_stats(), d.connector_stats()
    pre, results = h.run_pd(p, d, prompts, MAX_TOKENS)
    assert h.tokens(results) == expected
    after, decode_after = p.connector_stats(), d.connector_stats()
    if decode_after:  # a TP 1 decode: its worker answers in the engine process
        assert decode_after["failures"] == []
        assert decode_after["rooms_ok"] - decode_before["rooms_ok"] == len(prompts)
    for rid, r in pre.items():  # prefill stops one token short
        assert r.kv_transfer_params is not None
        assert r.kv_transfer_params["pdwire_num_tokens"] == len(prompts[rid]) - 1
    assert settle(lambda: kv_usage(p) == 0 and kv_usage(d) == 0)
    if not after:
        return {}
    assert after["failures"] == [] and after["rooms_ok"] - before["rooms_ok"] == len(prompts)
    return {"bytes": after["bytes_posted"] - before["bytes_posted"]}


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    ("prefill", "decode"), [("prefill", "decode"), ("prefill", "decode-tp2"), ("prefill-tp2", "decode")]
)
def test_sliding_window_moves_only_the_window_and_tokens_equal_one_engine(
    engines: dict[str, h.Engine], prompts: dict[str, list[int]], prefill: str, decode: str
) -> None:
    sent = _pd(engines, "", prefill, decode, prompts)
    if prefill == "prefill-tp2":
        return  # its ranks' counters live in vLLM's worker processes
    ns = [len(p) - 1 for p in prompts.values()]
    # per request: the full-attention layer's blocks of the prompt, and per sliding layer the
    # blocks in the window only (a whole-prompt copy moves 3 x the prompt's blocks)
    window = sum(math.ceil(n / BS) + 2 * _live(n) for n in ns) * BLOCK_BYTES
    whole = sum(3 * math.ceil(n / BS) for n in ns) * BLOCK_BYTES
    assert window < whole and sent["bytes"] == window


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_model_of_sliding_window_layers_only_moves_its_windows(
    engines: dict[str, h.Engine], prompts: dict[str, list[int]]
) -> None:
    sent = _pd(engines, "alone-", "alone-prefill", "alone-decode", prompts)
    window = sum(3 * _live(len(p) - 1) for p in prompts.values()) * BLOCK_BYTES
    assert sent["bytes"] == window


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_local_prefix_on_decode_moves_the_rest_or_computes_a_tail_inside_the_window(
    engines: dict[str, h.Engine], prompts: dict[str, list[int]]
) -> None:
    """Decode with prefix caching. A prompt sharing 4 blocks (128 tokens) with one decode served
    locally hits them (their window blocks are cached too) and loads the rest: the full layer's
    blocks past the prefix and the window's blocks (4..6 of n = 199, all past it). One sharing 5
    blocks reaches into the window (block 4): decode computes its 39-token tail itself."""
    prefill, decode, single = engines["prefill"], engines["decode-cached"], engines["single"]
    (base,) = [p for p in prompts.values() if len(p) == 200]
    rest, tail = (list(v) for v in h.random_prompts(2, 72, seed=40).values())
    cases = {"swa-prefix-128": base[:128] + rest, "swa-prefix-160": base[:160] + tail[:40]}
    expected = h.tokens(h.run_single(single, cases, MAX_TOKENS))
    # what decode served itself: vLLM caches a sliding layer's blocks of a hit only while they
    # are in the window of the request that computed them
    sharing = {"swa-local-130": base[:130], "swa-local-160": base[:160] + rest[:40]}
    stats, external = prefill.connector_stats(), h.external_prompt_tokens(decode.metrics())
    results = {}
    for rid, local in sharing.items():
        h.run_single(decode, {rid: local}, 1)
        case = "swa-prefix-128" if rid == "swa-local-130" else "swa-prefix-160"
        results.update(h.run_pd(prefill, decode, {case: cases[case]}, MAX_TOKENS)[1])
    assert h.tokens(results) == expected
    loaded = h.external_prompt_tokens(decode.metrics()) - external
    assert loaded == 199 - 128  # the first request's tokens past its local prefix; none of the second's
    sent = prefill.connector_stats()["bytes_posted"] - stats["bytes_posted"]
    assert sent == (3 + 2 * 3) * BLOCK_BYTES  # the full layer's blocks 4..6, each sliding layer's 4..6
