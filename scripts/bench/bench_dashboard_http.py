"""What an HTTP library costs a peer that serves the dashboard: import time, memory, requests/s.

    python scripts/bench/bench_dashboard_http.py [--requests 300]

Each candidate runs in a fresh process that imports it, serves one small JSON route on an
asyncio loop on 127.0.0.1, and answers `--requests` sequential GETs from a plain socket client in
the same loop. One result line per library and figure. The dashboard chose by these figures
(BENCHMARKS.md, "Dashboard").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r'''
import asyncio, resource, sys, time
lib, n = sys.argv[1], int(sys.argv[2])
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if lib == "aiohttp":
    from aiohttp import web
elif lib == "starlette+uvicorn":
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
import_s = time.perf_counter() - t0

async def client(port):
    t = time.perf_counter()
    for _ in range(n):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /api HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await w.drain()
        data = await r.read()
        assert b"200" in data.split(b"\r\n", 1)[0], data[:80]
        w.close()
    return n / (time.perf_counter() - t)

async def main():
    if lib == "aiohttp":
        async def api(request):
            return web.json_response({"ok": 1})
        app = web.Application()
        app.router.add_get("/api", api)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        rps = await client(port)
        await runner.cleanup()
    else:
        async def api(request):
            return JSONResponse({"ok": 1})
        app = Starlette(routes=[Route("/api", api)])
        import socket
        sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        rps = await client(port)
        server.should_exit = True
        await task
    return rps

rps = asyncio.run(main())
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(import_s, (rss1 - rss0) / 1024, rps)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    for lib in ("aiohttp", "starlette+uvicorn"):
        done = subprocess.run([sys.executable, "-c", CHILD, lib, str(args.requests)], check=False,
                              capture_output=True, text=True)
        if done.returncode != 0:  # e.g. aiohttp, which swarm does not install: pip install aiohttp to compare
            print(json.dumps({"lib": lib, "error": done.stderr.strip().splitlines()[-1:]}))
            continue
        out = done.stdout.split()
        import_s, mib, rps = map(float, out)
        print(json.dumps({"lib": lib, "import_ms": round(import_s * 1000, 1), "rss_added_mib": round(mib, 1),
                          "requests_per_s": round(rps)}))


if __name__ == "__main__":
    main()
