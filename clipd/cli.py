"""The ``clipd`` command: ``clipd serve`` runs the service, ``clipd demo`` exercises one.

``clipd demo`` with no ``--target`` starts a server in-process on loopback, so
it needs nothing else running.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
import time

import numpy as np

DEMO_LAYERS = {"dense/kernel": (32, 24), "dense/bias": (24,), "out/kernel": (8, 24), "out/bias": (8,)}


def _serve(args: argparse.Namespace) -> int:
    from clipd.server.app import serve
    from clipd.server.settings import Settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env(
        host=args.host, grpc_port=args.grpc_port, admin_port=args.admin_port, admin_token=args.token,
        compilation_cache_dir=args.compilation_cache_dir, data_dir=args.data_dir,
        retention_seconds=args.retention_seconds, checkpoint_interval=args.checkpoint_interval,
    )
    serve(settings)
    return 0


def _demo_updates(examples: int, seed: int) -> dict[str, np.ndarray]:
    """Synthetic per-example updates whose norms spread around 1, so about half get clipped."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0.0, 1.0, examples)).astype(np.float32)
    out = {}
    for name, shape in DEMO_LAYERS.items():
        size = math.prod(shape)
        x = rng.standard_normal((examples, *shape)).astype(np.float32) / np.sqrt(size * len(DEMO_LAYERS))
        out[name] = x * scale.reshape((-1,) + (1,) * len(shape))
    return out


def _demo(args: argparse.Namespace) -> int:
    from clipd.client import Client

    server = None
    target = args.target
    with tempfile.TemporaryDirectory(prefix="clipd-demo-") as data_dir:
        if target is None:
            from clipd.server.app import create_server
            from clipd.server.settings import Settings

            server, port = create_server(Settings(host="127.0.0.1", grpc_port=0, admin_port=-1,
                                                  max_device_rows=256, data_dir=data_dir))
            target = f"127.0.0.1:{port}"
            print(f"started an embedded clipd server on {target} (state in a temporary directory)")
        try:
            updates = _demo_updates(args.examples, args.seed)
            with Client(target, token=args.token, retry_timeout=args.retry_timeout) as client:
                aggregation = client.create_aggregation(DEMO_LAYERS, policy=args.policy, l2_norm_clip=args.clip)
                try:
                    started = time.perf_counter()
                    report = client.submit(aggregation, updates)
                    result = client.finalize(aggregation)
                    seconds = time.perf_counter() - started
                finally:
                    client.cancel(aggregation)  # the demo leaves nothing behind on the server
            return _report(result, updates, args, report, seconds)
        finally:
            if server is not None:
                server.stop(grace=1.0)


def _report(result, updates, args, report, seconds) -> int:
    import jax.numpy as jnp

    from clipd import engine

    names = list(DEMO_LAYERS)
    grads = [jnp.asarray(updates[n]) for n in names]
    if args.policy == "global":
        ref_sums, count = engine.per_example_global_norm_clip(grads, args.clip)
        ref_counts = [int(count)] * len(names)
    else:
        uniform = args.policy == "per_layer_uniform"
        ref_sums, counts = engine.per_example_layer_norm_clip(grads, args.clip, uniform=uniform)
        ref_counts = [int(c) for c in counts]
    print(f"aggregated {result.examples} examples in {report.batches} batches, {seconds:.2f} s "
          f"(policy {args.policy}, C = {args.clip})")
    print(f"{'layer':<14} {'shape':<10} {'clipped':>8} {'expected':>8} {'|sum|':>10} {'max error':>10}")
    ok = result.examples == args.examples
    for name, ref_sum, ref_count in zip(names, ref_sums, ref_counts):
        ours = result.sums[name]
        err = float(np.max(np.abs(ours - np.asarray(ref_sum)))) / max(1e-30, float(np.max(np.abs(ref_sum))))
        good = result.clip_counts[name] == ref_count and err < 1e-5
        ok &= good
        print(f"{name:<14} {str(tuple(ours.shape)):<10} {result.clip_counts[name]:>8} {ref_count:>8} "
              f"{np.linalg.norm(ours):>10.4f} {err:>10.2e}{'' if good else '  MISMATCH'}")
    print("result matches the in-process computation" if ok else "RESULT DOES NOT MATCH")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clipd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gRPC service and its admin API")
    serve.add_argument("--host", default=None, help="address to bind (env CLIPD_HOST; default 127.0.0.1)")
    serve.add_argument("--grpc-port", type=int, default=None, help="env CLIPD_GRPC_PORT; default 50051")
    serve.add_argument("--admin-port", type=int, default=None, help="env CLIPD_ADMIN_PORT; default 8080, -1 off")
    serve.add_argument("--token", default=None, help="require this bearer token (env CLIPD_AUTH_TOKEN)")
    serve.add_argument("--compilation-cache-dir", default=None, help="JAX persistent compilation cache")
    serve.add_argument("--data-dir", default=None,
                       help="where aggregations, checkpoints and results are kept (env CLIPD_DATA_DIR;"
                            " default: ~/.local/state/clipd; 'memory': nothing survives a restart)")
    serve.add_argument("--retention-seconds", type=float, default=None,
                       help="finalized results are deleted after this (env CLIPD_RETENTION_SECONDS; default 86400)")
    serve.add_argument("--checkpoint-interval", type=float, default=None,
                       help="seconds between checkpoints, about the acknowledgement latency (default 0.01)")
    serve.set_defaults(run=_serve)
    demo = sub.add_parser("demo", help="stream synthetic updates and check the aggregate")
    demo.add_argument("--target", default=None, help="HOST:PORT of a server (default: start one in-process)")
    demo.add_argument("--token", default=None)
    demo.add_argument("--examples", type=int, default=2000)
    demo.add_argument("--clip", type=float, default=1.0)
    demo.add_argument("--policy", default="global",
                      choices=["global", "per_layer_uniform", "per_layer_proportional"])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--retry-timeout", type=float, default=60.0,
                      help="how long to retry an unreachable or restarting server (seconds)")
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
