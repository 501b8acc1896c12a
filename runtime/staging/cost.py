"""Direct or staged: a cost model over measured per-row and per-byte costs, per part.

The time of one part is estimated from what it would cost each stage::

    direct  = post + rows x engine_row + bytes x engine_byte
    gather  = rows x copy_row + bytes x copy_byte            (host copy into staging)
              + post + dst_runs x engine_row + bytes x engine_byte
    scatter = post + src_runs x engine_row + bytes x engine_byte
              + rows x copy_row + bytes x copy_byte          (the peer's copy out of staging)
    both    = two host copies + post + a few large rows

and the cheapest mode wins if it saves at least ``min_saving`` of the direct time (a staged
part holds staging memory and adds a copy; a marginal win is not worth it). The constants are
per engine (``COSTS``), measured with ``benchmarks/staging_costs.py`` on the development VM
(2 shared cores): they are what decides, so a deployment measures its own and passes them in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdwire.runtime.descriptors import DescriptorTable
from pdwire.runtime.staging.transform import MAX_WRITE_ROW, Mode, runs


@dataclass(frozen=True, slots=True)
class Costs:
    """Seconds per engine post, per engine row, per byte the engine moves, per row and per byte
    of a host copy (gather or scatter)."""

    post_s: float
    engine_row_s: float
    engine_byte_s: float
    copy_row_s: float = 0.1e-6
    copy_byte_s: float = 1 / 6.5e9


# Measured with benchmarks/staging_costs.py on the 2-core development VM at load ~1-2 (fits of
# post -> DONE medians over 256-16384 rows of 512 B-32 KiB; two runs, rounded between them; see
# docs/request-efficiency.md). Mooncake's from benchmarks/transfer.py (4 KiB rows, 16k/s). The
# host copy is HostCopier's numpy take of equal-length rows (0.01-0.1 us per row, 6-7.5 GB/s).
COSTS: dict[str, Costs] = {
    "nixl": Costs(post_s=300e-6, engine_row_s=3.5e-6, engine_byte_s=1 / 4e9),
    "local": Costs(post_s=250e-6, engine_row_s=1.0e-6, engine_byte_s=1 / 3e9),
    "mooncake": Costs(post_s=300e-6, engine_row_s=50e-6, engine_byte_s=1 / 1.3e9),
}
GENERIC = Costs(post_s=60e-6, engine_row_s=2e-6, engine_byte_s=1 / 5e9)


@dataclass(frozen=True, slots=True)
class Choice:
    """The mode picked for one part and every estimate it was picked from (seconds)."""

    mode: Mode
    estimates: dict[Mode, float] = field(default_factory=dict)

    @property
    def saving(self) -> float:
        """Estimated fraction of the direct time saved."""
        d = self.estimates.get(Mode.DIRECT, 0.0)
        return 0.0 if d <= 0 else 1 - self.estimates[self.mode] / d


@dataclass(frozen=True, slots=True)
class CostModel:
    costs: Costs
    min_saving: float = 0.25  # stage only when it saves at least this fraction of the direct time
    min_rows: int = 256  # below this a table is never staged: the saving cannot pay for the copy

    @classmethod
    def for_backend(cls, name: str, **overrides: float) -> CostModel:
        return cls(COSTS.get(name, GENERIC), **overrides)  # type: ignore[arg-type]

    def estimate(self, mode: Mode, rows: int, nbytes: int, engine_rows: int) -> float:
        c = self.costs
        engine = c.post_s + engine_rows * c.engine_row_s + nbytes * c.engine_byte_s
        copies = {Mode.DIRECT: 0, Mode.GATHER: 1, Mode.SCATTER: 1, Mode.BOTH: 2}[mode]
        return engine + copies * (rows * c.copy_row_s + nbytes * c.copy_byte_s)

    def choose(self, table: DescriptorTable, modes: tuple[Mode, ...] = (Mode.GATHER,)) -> Choice:
        """The cheapest of DIRECT and ``modes`` (the staging this part may use) for ``table``."""
        rows, nbytes = len(table), table.total_bytes
        est = {Mode.DIRECT: self.estimate(Mode.DIRECT, rows, nbytes, rows)}
        if rows < self.min_rows:
            return Choice(Mode.DIRECT, est)
        for mode in modes:
            if mode is Mode.GATHER:
                engine_rows = runs(table, "dst")
            elif mode is Mode.SCATTER:
                engine_rows = runs(table, "src")
            elif mode is Mode.BOTH:
                engine_rows = max(1, math.ceil(nbytes / MAX_WRITE_ROW))
            else:
                continue
            est[mode] = self.estimate(mode, rows, nbytes, engine_rows)
        best = min(est, key=est.__getitem__)
        if best is not Mode.DIRECT and est[best] > (1 - self.min_saving) * est[Mode.DIRECT]:
            best = Mode.DIRECT
        return Choice(best, est)
