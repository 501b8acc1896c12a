"""Serve settings: file, environment and flags (in that order of strength), each refusal named."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdwire.serve.config import ServeConfigError, build_config, load_file
from pdwire.serve.ranks import open_memory, room_id, tokens_of


def test_flags_over_environment_over_file(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(
        "role: prefill\nengine_id: from-file\ntp: 2\nbind: 10.0.0.1:17000\n"
        "backend_options: {hostname: from-file, max_batch: 64}\nmemory: {layers: 2, page_size: 4}\n"
    )
    env = {"PDWIRE_BIND": "10.0.0.2:18000", "PDWIRE_BACKEND_OPTIONS": "hostname=from-env"}
    cfg = build_config(
        "prefill",
        file=load_file(f),
        flags={"engine_id": "from-flag", "tp": None},
        backend_option_flags=["protocol=tcp"],
        environ=env,
    )
    assert cfg.engine_id == "from-flag" and cfg.tp == 2
    assert cfg.bind == "10.0.0.2:18000"
    assert cfg.backend_options == {"hostname": "from-env", "max_batch": 64, "protocol": "tcp"}
    assert (cfg.memory.layers, cfg.memory.page_size, cfg.memory.head_dim) == (2, 4, 64)


def test_rank_endpoints() -> None:
    cfg = build_config(
        "prefill",
        flags={"engine_id": "p", "tp": 2, "bind": "0.0.0.0:17000", "advertise": "10.0.0.1"},
        environ={},
    )
    assert [cfg.rank_bind(r) for r in (0, 1)] == ["tcp://0.0.0.0:17000", "tcp://0.0.0.0:17001"]
    assert cfg.rank_advertise(1) == "tcp://10.0.0.1"  # the bound port
    assert cfg.advertise_host == "10.0.0.1"
    cfg = build_config(
        "prefill", flags={"engine_id": "p", "bind": "[::1]", "advertise": "[fd00::1]:9000"}, environ={}
    )
    assert cfg.rank_bind(0) == "tcp://[::1]:0" and cfg.rank_advertise(0) == "tcp://[fd00::1]:9000"
    assert build_config("decode", flags={"engine_id": "d"}, environ={}).advertise_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("role", "flags", "named"),
    [
        ("prefill", {}, "engine_id: required"),
        ("prefill", {"engine_id": "p", "bind": "0.0.0.0"}, "give --advertise"),
        ("prefill", {"engine_id": "p", "advertise": "0.0.0.0"}, "advertise: '0.0.0.0' is a wildcard"),
        ("prefill", {"engine_id": "p", "bind": "h:x"}, "bind/advertise"),
        ("prefill", {"engine_id": "p", "tp": 2, "ranks": "0,2"}, "ranks: rank 2 is outside 0..1"),
        ("decode", {"engine_id": "d", "tp": 2, "ranks": "1"}, "runs all its TP ranks in one process"),
        ("decode", {"engine_id": "d", "discovery": "etcd://h", "prefill": ["p=tcp://h:1"]}, "not both"),
        ("prefill", {"engine_id": "p", "room_timeout_s": 0.0}, "room_timeout_s"),
        ("decode", {"engine_id": "d", "min_tokens": 9, "max_tokens": 8}, "min_tokens/max_tokens"),
        ("prefill", {"engine_id": "p", "tp": "2"}, "flag tp: must be int, got '2'"),
        ("prefill", {"engine_id": "p", "log_level": "loud"}, "log_level"),
    ],
)
def test_refusals_name_the_setting(role: str, flags: dict[str, object], named: str) -> None:
    with pytest.raises(ServeConfigError) as info:
        build_config(role, flags=flags, environ={})
    assert named in str(info.value)


def test_file_refusals(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("engine_id: p\nlisten: 1\n")
    with pytest.raises(ServeConfigError, match=r"c\.yaml listen: unknown setting"):
        build_config("prefill", file=load_file(f), file_name=str(f), environ={})
    with pytest.raises(ServeConfigError, match=r"memory\.heads: unknown"):
        build_config("prefill", file={"engine_id": "p", "memory": {"heads": 4}}, environ={})
    with pytest.raises(ServeConfigError, match=r"memory\.model"):
        build_config("prefill", file={"engine_id": "p", "memory": {"model": ""}}, environ={})
    # a model nobody registered is refused when serve opens it, naming the ones it knows
    cfg = build_config("prefill", file={"engine_id": "p", "memory": {"model": "llama"}}, environ={})
    with pytest.raises(ValueError, match=r"memory\.model 'llama': serve knows"):
        open_memory(cfg)
    with pytest.raises(ServeConfigError, match="'decode', but the command serves 'prefill'"):
        build_config("prefill", file={"role": "decode"}, environ={})
    with pytest.raises(ServeConfigError, match="backend options"):
        build_config("prefill", flags={"engine_id": "p"}, backend_option_flags=["hostname"], environ={})
    f.write_text("[1, 2]\n")
    with pytest.raises(ServeConfigError, match="a mapping"):
        load_file(f)


def test_room_ids_carry_the_prompt_length() -> None:
    assert tokens_of(room_id(7, 300)) == 300
    assert room_id(1, 1) != room_id(2, 1)
    with pytest.raises(ValueError):
        room_id(1, 0)
    with pytest.raises(ValueError):
        room_id(1, 1 << 16)


def test_a_decode_server_refused_at_start_up_leaves_no_admin_socket(tmp_path: Path) -> None:
    """The admin socket is bound before the memory model opens: a model serve does not know
    closes it again (and its file goes), so a retry with the same path starts clean."""
    from pdwire.discovery import StaticDiscovery
    from pdwire.serve.decode import DecodeServer

    admin = tmp_path / "decode.sock"
    cfg = build_config(
        "decode",
        file={"engine_id": "d", "admin": str(admin), "memory": {"model": "llama"}},
        environ={},
    )
    with pytest.raises(ValueError, match=r"memory\.model 'llama'"):
        DecodeServer(cfg, StaticDiscovery())
    assert not admin.exists()
