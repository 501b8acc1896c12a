"""The demo model's shapes and pool sizes: plain values, no torch (the command line validates
its arguments against them before anything heavy is imported)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pdwire.runtime.planner import StateKind


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes of the demo model; every TP-sharded size must divide by both TP sizes."""

    layers: int = 4
    kv_heads: int = 8
    head_dim: int = 64
    page_size: int = 16
    mla: bool = False
    latent_dim: int = 96  # MLA: latent elements per token
    mamba_layers: int = 2
    conv_blocks: tuple[int, ...] = (32, 32, 64)  # full q|k|v conv channels
    conv_width: int = 3
    ssm_heads: int = 8
    ssm_head_dim: int = 8
    ssm_state: int = 16
    swa_layers: int = 2
    swa_window_pages: int = 4
    dsa_layers: int = 2
    dsa_dim: int = 32
    aux_bytes: int = 64

    @property
    def conv_channels(self) -> int:
        return sum(self.conv_blocks)

    def fingerprint(self) -> bytes:
        """Identity of the model: both sides must hold the same one (weights and geometry)."""
        return hashlib.sha256(repr(self).encode()).digest()[:16]

    def component_kinds(self) -> tuple[StateKind, ...]:
        """State components present, in order (a component with zero layers is absent)."""
        if self.mla:
            pairs = ((StateKind.SWA, self.swa_layers), (StateKind.DSA, self.dsa_layers))
        else:
            pairs = ((StateKind.MAMBA, self.mamba_layers), (StateKind.SWA, self.swa_layers))
        return tuple(k for k, n in pairs if n > 0)

    def check_tp(self, tp: int) -> None:
        sharded = [] if self.mla else [self.kv_heads, *self.conv_blocks, self.ssm_heads]
        for size in sharded:
            if size % tp:
                raise ValueError(f"model size {size} does not divide by TP {tp}; pick sizes divisible by TP")


@dataclass(frozen=True, slots=True)
class Capacity:
    """How many pages/slots/items each pool of a rank holds."""

    pages: int
    slots: int  # Mamba slots; slot 0 is the dummy slot and never handed out
    swa_pages: int
    aux_items: int


def pages_for(spec: ModelSpec, tokens: int) -> tuple[int, int]:
    """(KV pages, SWA pages) of a prompt of ``tokens`` tokens."""
    pages = -(-tokens // spec.page_size)
    return pages, min(pages, spec.swa_window_pages)


def capacity_for(spec: ModelSpec, lengths: list[int]) -> Capacity:
    """Pools that hold a prompt of each of ``lengths`` at once, with a little to spare."""
    pages = [pages_for(spec, n) for n in lengths]
    n = len(lengths) + 2
    return Capacity(sum(p for p, _ in pages) + 8, n, sum(s for _, s in pages) + 8, n)
