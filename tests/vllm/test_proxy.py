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

from pdwire.integrations.vllm.proxy import ProxyError, decode_body, make_app, prefill_body

PARAMS = {"do_remote_prefill": True, "pdwire_room": 7, "pdwire_endpoints": ["tcp://127.0.0.1:1"]}


def test_prefill_body_asks_for_one_token_kept_for_decode() -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 64, "stream": True, "stream_options": {"x": 1}}
    out = prefill_body(body)
    assert out["max_tokens"] == 1 and out["stream"] is False and "stream_options" not in out
    assert out["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["max_tokens"] == 64  # the client's request is not changed
    chat = prefill_body({"messages": [], "max_completion_tokens": 9})
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1


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
