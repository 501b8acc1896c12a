"""The disaggregated-serving proxy: request rewriting, and the HTTP flow over loopback against two
stand-in servers that record what they get (the flow with real vLLM servers is the same code;
tests/vllm runs the engines themselves)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdwire.integrations.vllm import params as tp
from pdwire.integrations.vllm.proxy import ProxyError, decode_body, forward_headers, make_app, prefill_body

PARAMS = {"do_remote_prefill": True, "pdwire_room": 7, "pdwire_endpoints": ["tcp://127.0.0.1:1"]}


def test_prefill_body_asks_for_one_token_kept_for_decode() -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 64, "stream": True, "stream_options": {"x": 1}}
    out = prefill_body(body)
    assert out["max_tokens"] == 1 and out["stream"] is False and "stream_options" not in out
    assert out["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["max_tokens"] == 64  # the client's request is not changed
    chat = prefill_body({"messages": [], "max_completion_tokens": 9})
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1
    # a minimum above the one token would make vLLM refuse the prefill request; decode keeps it
    floor = {"prompt": [1], "max_tokens": 9, "min_tokens": 4, "min_completion_tokens": 4}
    assert not {"min_tokens", "min_completion_tokens"} & set(prefill_body(floor))
    assert decode_body(floor, {"kv_transfer_params": PARAMS})["min_tokens"] == 4


def test_decode_body_carries_the_prefill_parameters_or_refuses_by_server() -> None:
    body = {"prompt": [1], "max_tokens": 5}
    assert decode_body(body, {"kv_transfer_params": PARAMS})["kv_transfer_params"] == PARAMS
    with pytest.raises(ProxyError, match="http://p:1 answered without kv_transfer_params"):
        decode_body(body, {"choices": []}, "http://p:1")


def _upstream(role: str, seen: list[dict[str, Any]]) -> web.Application:
    app = web.Application()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if role == "prefill":
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        if body.get("stream"):
            resp = web.StreamResponse()
            resp.content_type = "text/event-stream"
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"choices": [{"text": "decoded"}], "echo": body})

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    return app


def test_the_proxy_runs_prefill_then_decode_over_http() -> None:
    async def run() -> None:
        pre_seen: list[dict[str, Any]] = []
        dec_seen: list[dict[str, Any]] = []
        async with (
            TestServer(_upstream("prefill", pre_seen)) as p,
            TestServer(_upstream("decode", dec_seen)) as d,
        ):
            app = make_app([str(p.make_url(""))], [str(d.make_url(""))])
            async with TestClient(TestServer(app)) as client:
                resp = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 8})
                assert resp.status == 200
                out = await resp.json()
                assert out["choices"][0]["text"] == "decoded"
                assert pre_seen[0]["max_tokens"] == 1 and pre_seen[0]["kv_transfer_params"] == {
                    "do_remote_decode": True
                }
                assert dec_seen[0]["max_tokens"] == 8 and dec_seen[0]["kv_transfer_params"] == PARAMS
                streamed = await client.post("/v1/chat/completions", json={"messages": [], "stream": True})
                text = await streamed.text()
                assert text.count("data:") == 4 and text.endswith("data: [DONE]\n\n")
                assert pre_seen[1]["stream"] is False and dec_seen[1]["stream"] is True
                health = await (await client.get("/healthz")).json()
                assert health["prefill"] and health["decode"]

    asyncio.run(run())


def test_a_prefill_without_a_connector_is_a_502_naming_it() -> None:
    async def run() -> None:
        bare = web.Application()

        async def answer(request: web.Request) -> web.Response:
            return web.json_response({"choices": []})

        bare.router.add_post("/v1/completions", answer)
        async with (
            TestServer(bare) as p,
            TestServer(_upstream("decode", [])) as d,
            TestClient(TestServer(make_app([str(p.make_url(""))], [str(d.make_url(""))]))) as client,
        ):
            resp = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
            assert resp.status == 502
            assert "answered without kv_transfer_params" in (await resp.json())["error"]["message"]

    asyncio.run(run())


# A prefill's parameters as the connector returns them: a room near 2**63, as rooms are (a
# 63-bit hash), which no double holds exactly.
HANDLE = tp.PrefillHandle(
    room=2**63 - 12345,
    engine_id="prefill-a",
    endpoints=("tcp://10.0.0.1:17000", "tcp://10.0.0.1:17001"),
    pp_size=1,
    num_tokens=80,
    block_size=32,
)


def _go_router(params: dict[str, Any]) -> dict[str, Any]:
    """What a router that decodes JSON into doubles sends on (Go's ``map[string]any``, as llm-d's
    routing sidecar does; Go writes an integral double below 1e21 as its integer digits)."""
    held = json.loads(json.dumps(params), parse_int=float)

    def go(value: Any) -> Any:
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
            return int(value)
        if isinstance(value, list):
            return [go(v) for v in value]
        if isinstance(value, dict):
            return {k: go(v) for k, v in value.items()}
        return value

    out: dict[str, Any] = json.loads(json.dumps(go(held)))
    return out


def test_the_parameters_survive_a_router_that_holds_numbers_as_doubles() -> None:
    params = HANDLE.to_params()
    assert tp.parse(_go_router(params)) == HANDLE
    # what the room as a JSON number would have become: another room
    assert _go_router({"room": HANDLE.room})["room"] != HANDLE.room
    # an older prefill's integer room is still read; a room that is no decimal number is refused
    assert tp.parse(dict(params, pdwire_room=HANDLE.room)).room == HANDLE.room
    for bad in ("-5", "0x10", "1e9", "", "0"):
        with pytest.raises(tp.TransferParamsError, match="pdwire_room"):
            tp.parse(dict(params, pdwire_room=bad))


def _nixl_router_legs(body: dict[str, Any], answer: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two requests a router written for NixlConnector makes (vLLM's toy proxy and llm-d's
    sidecar, as they read): a prefill request with NIXL's null fields, then the client's request
    with the prefill answer's parameters, whole."""
    pre = dict(body, stream=False, max_tokens=1)
    pre["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    dec = dict(body)
    if answer.get("kv_transfer_params"):
        dec["kv_transfer_params"] = answer["kv_transfer_params"]
    return pre, dec


def test_a_nixl_router_and_the_proxy_hand_decode_the_same_prefill() -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8}
    answer = {"choices": [{"text": "x"}], "kv_transfer_params": HANDLE.to_params()}
    pre, dec = _nixl_router_legs(body, answer)
    ours = decode_body(body, answer)
    assert tp.parse(_go_router(dec["kv_transfer_params"])) == tp.parse(ours["kv_transfer_params"]) == HANDLE
    assert ours["kv_transfer_params"] == answer["kv_transfer_params"]  # whole and untouched
    # a field a router adds (vLLM's multi-turn example proxy sets the prefill's host) is ignored
    assert tp.parse(dict(dec["kv_transfer_params"], remote_host="10.0.0.1")) == HANDLE
    # what the prefill connector keys on is set in both prefill requests
    assert (
        pre["kv_transfer_params"]["do_remote_decode"]
        and prefill_body(body)["kv_transfer_params"]["do_remote_decode"]
    )


def test_both_legs_carry_one_request_id() -> None:
    assert forward_headers({"X-Request-Id": "abc", "Cookie": "c"}) == {"X-Request-Id": "abc"}
    made = forward_headers({"Authorization": "Bearer k"})
    assert made["Authorization"] == "Bearer k" and len(made["X-Request-Id"]) == 36
    assert forward_headers({})["X-Request-Id"] != forward_headers({})["X-Request-Id"]

    async def run() -> None:
        ids: list[tuple[str, str | None]] = []

        def recorder(role: str) -> web.Application:
            app = web.Application()

            async def completions(request: web.Request) -> web.Response:
                ids.append((role, request.headers.get("X-Request-Id")))
                return web.json_response({"choices": [], "kv_transfer_params": PARAMS})

            app.router.add_post("/v1/completions", completions)
            return app

        async with (
            TestServer(recorder("prefill")) as p,
            TestServer(recorder("decode")) as d,
            TestClient(TestServer(make_app([str(p.make_url(""))], [str(d.make_url(""))]))) as client,
        ):
            for _ in range(2):
                assert (await client.post("/v1/completions", json={"prompt": [1]})).status == 200
        assert [r for r, _ in ids] == ["prefill", "decode"] * 2
        assert ids[0][1] == ids[1][1] and ids[2][1] == ids[3][1] and ids[0][1] != ids[2][1]

    asyncio.run(run())
