"""A minimal OpenAI-style streaming chat server for bench unit tests (not the launch/ sim).

It answers /v1/models, streaming /v1/chat/completions (one word per token, `--token-ms` apart)
and /metrics with the SGLang load gauges, so the tools can be tested without the full stack.
"""

import argparse
import asyncio
import json

from aiohttp import web


def build_app(token_ms: float) -> web.Application:
    state = {"running": 0, "generated": 0}

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def metrics(_request):
        text = (
            f'sglang:num_running_reqs{{engine="fake"}} {state["running"]}\n'
            'sglang:num_queue_reqs{engine="fake"} 0\n'
            f'sglang:generation_tokens_total{{engine="fake"}} {state["generated"]}\n'
        )
        return web.Response(text=text)

    async def chat(request):
        body = await request.json()
        words = sum(len(m["content"].split()) for m in body["messages"])
        # sglang.bench_serving sends max_completion_tokens, our client max_tokens.
        max_tokens = body.get("max_tokens") or body["max_completion_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        state["running"] += 1
        try:
            for i in range(max_tokens):
                await asyncio.sleep(token_ms / 1000)
                state["generated"] += 1
                event = {"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            usage = {"prompt_tokens": words, "completion_tokens": max_tokens}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        finally:
            state["running"] -= 1
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-ms", type=float, default=1.0)
    args = parser.parse_args()
    web.run_app(build_app(args.token_ms), host="127.0.0.1", port=args.port, print=None)
