"""A small disaggregated-serving proxy in front of vLLM OpenAI servers running PdwireConnector.

    python -m pdwire.integrations.vllm.proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

For each ``/v1/completions`` or ``/v1/chat/completions`` request it does what vLLM's own
example proxy does for NixlConnector: send the request to a prefill server with
``max_tokens=1``, no streaming and ``kv_transfer_params={"do_remote_decode": true}``; take the
``kv_transfer_params`` of its answer (pdwire's room, the prefill ranks' endpoints, the token
count) and send the original request with them to a decode server, whose answer (streamed or
not) goes back to the client. Several ``--prefill`` / ``--decode`` servers are used round robin.
The parameters are opaque to the proxy: any connector that returns them works the same way.

It does what routers written for NixlConnector do (vLLM's toy proxy, llm-d's routing sidecar),
so either fronts a pdwire deployment: the answer's parameters go to decode whole and untouched;
``min_tokens`` / ``min_completion_tokens`` stay off the one-token prefill request (vLLM refuses
them above ``max_tokens``) and reach decode; both legs carry one ``X-Request-Id`` (the
client's, else a new one) so the two servers' logs name the same request.

The request rewriting is pure (:func:`prefill_body`, :func:`decode_body`) and the server is
aiohttp (a vLLM dependency).
"""

from __future__ import annotations

import argparse
import itertools
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

ROUTES = ("/v1/completions", "/v1/chat/completions")
# what a one-token prefill request must not carry (vLLM refuses a minimum above max_tokens)
DECODE_ONLY = ("min_tokens", "min_completion_tokens", "stream_options")
FORWARDED_HEADERS = ("authorization", "x-request-id")


class ProxyError(RuntimeError):
    """A prefill answer without usable transfer parameters; names the server."""


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill server's request: one token, no streaming, and keep the KV for decode."""
    out = dict(body)
    out["kv_transfer_params"] = {"do_remote_decode": True}
    out["stream"] = False
    for key in DECODE_ONLY:
        out.pop(key, None)
    for key in ("max_tokens", "max_completion_tokens"):
        if key in out or key == "max_tokens":
            out[key] = 1
    return out


def decode_body(
    body: Mapping[str, Any], prefill_answer: Mapping[str, Any], server: str = "prefill"
) -> dict[str, Any]:
    """The decode server's request: the client's, with the prefill's transfer parameters."""
    params = prefill_answer.get("kv_transfer_params")
    if not isinstance(params, Mapping) or not params:
        raise ProxyError(
            f"{server} answered without kv_transfer_params; is it running with a KV connector as kv_producer?"
        )
    out = dict(body)
    out["kv_transfer_params"] = dict(params)
    return out


def forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers both servers get: its authorization, and one request id for both legs."""
    out = {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}
    if not any(k.lower() == "x-request-id" for k in out):
        out["X-Request-Id"] = str(uuid.uuid4())
    return out


def _round_robin(urls: Sequence[str]) -> tuple[list[str], Iterator[str]]:
    if not urls:
        raise ValueError("at least one server URL is needed")
    urls = [u.rstrip("/") for u in urls]
    return urls, itertools.cycle(urls)


def make_app(prefill: Sequence[str], decode: Sequence[str], timeout_s: float = 600.0) -> Any:
    """The aiohttp application (``aiohttp.web.Application``)."""
    import aiohttp
    from aiohttp import web

    (prefill_urls, prefills), (decode_urls, decodes) = _round_robin(prefill), _round_robin(decode)
    app = web.Application()
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def on_startup(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def on_cleanup(app: web.Application) -> None:
        await app[session_key].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session = request.app[session_key]
        headers = forward_headers(request.headers)
        p_url = next(prefills) + request.path
        async with session.post(p_url, json=prefill_body(body), headers=headers) as resp:
            if resp.status != 200:
                return web.Response(
                    status=resp.status, body=await resp.read(), content_type=resp.content_type
                )
            answer = await resp.json()
        try:
            d_body = decode_body(body, answer, p_url)
        except ProxyError as exc:
            return web.json_response({"error": {"message": str(exc), "type": "proxy_error"}}, status=502)
        d_url = next(decodes) + request.path
        async with session.post(d_url, json=d_body, headers=headers) as resp:
            out = web.StreamResponse(status=resp.status)
            out.content_type = resp.content_type
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"prefill": prefill_urls, "decode": decode_urls})

    for route in ROUTES:
        app.router.add_post(route, forward)
    app.router.add_get("/healthz", health)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", action="append", required=True, help="prefill server URL (repeatable)")
    parser.add_argument("--decode", action="append", required=True, help="decode server URL (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    from aiohttp import web

    web.run_app(make_app(args.prefill, args.decode, args.timeout_s), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
