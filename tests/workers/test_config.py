"""Worker configuration: the grid position and its unique ranks, endpoints, and one typed error
naming the field for everything that cannot work."""

from __future__ import annotations

import itertools

import pytest

from pdwire import wire
from pdwire.runtime.engine import ConfigError, DecodeConfig, ParallelRank, PrefillConfig
from pdwire.runtime.session.hello import geometry_of, rank_of

MODEL = wire.ModelFingerprint(model_name="m", revision="r", dtype="bf16", num_layers=2)


def test_sender_rank_is_sglangs_formula_and_unique_over_the_tp_pp_cp_grid() -> None:
    tp, pp, cp = 4, 3, 2
    seen = set()
    for t, p, c in itertools.product(range(tp), range(pp), range(cp)):
        r = ParallelRank(tp, t, pp, p, cp, c)
        assert r.sender_rank == t * (pp * cp) + p * cp + c  # prefill_unique_rank
        seen.add(r.sender_rank)
    assert seen == set(range(tp * pp * cp))


def test_engine_rank_is_unique_across_attention_dp_groups() -> None:
    ranks = {
        ParallelRank(2, t, 2, p, dp_size=3, dp_rank=d).engine_rank
        for t in range(2)
        for p in range(2)
        for d in range(3)
    }
    assert ranks == set(range(12))
    # the sender rank repeats per DP group (a request is served by one group)
    assert (
        ParallelRank(2, 1, dp_size=2, dp_rank=0).sender_rank
        == ParallelRank(2, 1, dp_size=2, dp_rank=1).sender_rank
    )


def test_geometry_round_trips() -> None:
    r = ParallelRank(4, 3, 2, 1, 1, 0, 2, 1)
    assert rank_of(geometry_of(r), "peer") == r


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"tp_size": 0}, "tp_size"), ({"tp_size": 2, "tp_rank": 2}, "tp_rank"), ({"pp_rank": -1}, "pp_rank"),
     ({"dp_size": 2, "dp_rank": 5}, "dp_rank")],
)  # fmt: skip
def test_a_rank_outside_its_grid_is_refused_by_field(kw: dict[str, int], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ParallelRank(**kw)


def test_prefill_bind_and_advertise() -> None:
    cfg = PrefillConfig(engine_id="p", rank=ParallelRank(), model=MODEL)
    assert cfg.advertised(5555) == "tcp://127.0.0.1:5555"  # default: the bound address
    cfg = PrefillConfig(
        engine_id="p", rank=ParallelRank(), model=MODEL, bind="tcp://0.0.0.0:0", advertise="tcp://10.1.2.3"
    )
    assert cfg.advertised(4000) == "tcp://10.1.2.3:4000"  # no port: the bound one
    cfg = PrefillConfig(engine_id="p", rank=ParallelRank(), model=MODEL, bind="tcp://[::1]:7000")
    assert cfg.bind_endpoint().is_ipv6 and cfg.advertised(7000) == "tcp://[::1]:7000"


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"bind": "127.0.0.1:5"}, "tcp://HOST:PORT"),
        ({"bind": "tcp://127.0.0.1"}, "no port"),
        ({"bind": "tcp://127.0.0.1:99999"}, "0..65535"),
        ({"bind": "tcp://0.0.0.0:0"}, "advertise"),
        ({"engine_id": ""}, "engine_id"),
        ({"room_timeout_s": 0}, "room_timeout_s"),
        ({"versions": ((1,),)}, "versions"),
        ({"rank": ParallelRank(cp_size=2)}, "context parallelism"),
    ],
)
def test_a_prefill_config_that_cannot_work_is_refused_by_field(kw: dict[str, object], needle: str) -> None:
    args: dict[str, object] = {"engine_id": "p", "rank": ParallelRank(), "model": MODEL, **kw}
    with pytest.raises(ConfigError, match=needle):
        PrefillConfig(**args)  # type: ignore[arg-type]


def test_decode_config_defaults() -> None:
    cfg = DecodeConfig(engine_id="d", rank=ParallelRank(2, 1, dp_size=2, dp_rank=1), model=MODEL)
    assert cfg.advertised() == "decode:d/3"
    with pytest.raises(ConfigError, match="fence_timeout_s"):
        DecodeConfig(engine_id="d", rank=ParallelRank(), model=MODEL, fence_timeout_s=-1)
