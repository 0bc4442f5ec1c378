"""What the fleet ingress's extra hop costs (issue 16): TTFT and per-token latency of streaming
completions through the ingress (HTTP -> Serve proxy -> ingress -> replica) against a replica
that is the HTTP entry itself (``build_app(ingress=False)``), in the same Ray run, on one
replica each, requests alternating between the two. Not a test (no gate on a time; pytest
does not collect it); needs the ``[ray]`` extra; run:

    python tests/measure_ingress_hop.py [--requests 40] [--tokens 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

try:
    import ray
    from ray import serve
except ImportError as exc:  # an optional extra: say so instead of a traceback
    raise SystemExit(f"measure_ingress_hop.py needs Ray: pip install -e '.[ray]' ({exc})") from None

from calexec.drivers.fleet.ray_serve import ReplicaSettings, build_app  # noqa: E402
from test_server_support import free_port  # noqa: E402


def one(client: httpx.Client, url: str, tokens: int, prompt: list[int]) -> tuple[float, list]:
    gaps, t0 = [], time.perf_counter()
    first = last = None
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True}
    with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if not json.loads(line[6:])["choices"][0].get("token_ids"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now - t0
            else:
                gaps.append(now - last)
            last = now
    return first, gaps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--decode-us", type=int, default=2000)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ReplicaSettings(device_config=f"decode_us={args.decode_us}")
        serve.run(build_app(settings, 1), name="fleet", route_prefix="/fleet")
        serve.run(build_app(settings, 1, ingress=False), name="direct", route_prefix="/direct")
        base = f"http://127.0.0.1:{port}"
        routes = {"ingress": f"{base}/fleet/v1/completions",
                  "direct": f"{base}/direct/v1/completions"}
        ttft: dict[str, list] = {k: [] for k in routes}
        gaps: dict[str, list] = {k: [] for k in routes}
        with httpx.Client(timeout=60) as client:
            for url in routes.values():  # warm-up
                one(client, url, 2, [1, 2])
            for i in range(args.requests):
                for name, url in routes.items():
                    first, g = one(client, url, args.tokens, [i % 50 + 1, 2, 3])
                    ttft[name].append(first)
                    gaps[name].extend(g)

        def ms(values: list, q: float) -> float:
            return statistics.quantiles(values, n=100)[q - 1] * 1e3 if q != 50 else \
                statistics.median(values) * 1e3
        print(f"{args.requests} streaming requests x {args.tokens} tokens each, decode "
              f"{args.decode_us} us/token, alternating, 1 replica per app:")
        for name in routes:
            print(f"  {name:8s} TTFT p50 {ms(ttft[name], 50):6.2f} ms p90 {ms(ttft[name], 90):6.2f}"
                  f" ms | inter-token p50 {ms(gaps[name], 50):6.2f} ms p90 "
                  f"{ms(gaps[name], 90):6.2f} ms")
        print(f"  extra hop: TTFT p50 +{ms(ttft['ingress'], 50) - ms(ttft['direct'], 50):.2f} ms,"
              f" inter-token p50 +{ms(gaps['ingress'], 50) - ms(gaps['direct'], 50):.2f} ms")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
