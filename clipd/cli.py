"""The ``clipd`` command: ``clipd serve`` runs the service, ``clipd demo`` exercises it, ``clipd status`` shows it,
``clipd token`` issues a client's credential.

``clipd demo`` with no ``--target`` starts a server in-process on loopback, so
it needs nothing else running.

``clipd serve`` and the embedded server of ``clipd demo`` need the server extra
(``pip install '.[server]'``); ``clipd demo --target HOST:PORT`` needs only
the client side (numpy, grpcio, protobuf), and ``clipd status`` only the
standard library (it reads the admin HTTP API with urllib). Nothing of the
server is imported before a command that needs it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from clipd.status import AGGREGATION_STATES, DEFAULT_ADMIN

if TYPE_CHECKING:  # numpy is imported where it is used: `clipd serve` tunes the process before it loads
    import numpy as np

DEMO_LAYERS = {"dense/kernel": (32, 24), "dense/bias": (24,), "out/kernel": (8, 24), "out/bias": (8,)}


EXIT_SETTINGS, EXIT_RUNTIME = 2, 1
EXIT_REFUTED = 3  # clipd audit: the audit's lower bound passes the claimed epsilon (a privacy bug)
CHOICES = {"log_level": ("debug", "info", "warning", "error"), "log_format": ("text", "json")}
FLAG_TYPES = {"int": int, "float": float, "str": str}


def _error(message: object, status: int) -> int:
    """Prints ``clipd: error: <message>`` as one line on stderr and returns ``status``."""
    text = " ".join(str(message).split())
    print(f"clipd: error: {text}", file=sys.stderr, flush=True)
    return status


def _field_comments() -> dict[str, str]:
    """Each Settings field's comment in clipd/server/settings.py: the one after it, else the comment lines above it."""
    import dataclasses
    import inspect
    import io
    import re
    import tokenize

    from clipd.server.settings import Settings

    try:
        source = inspect.getsource(Settings)
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, tokenize.TokenError):
        return {}
    comment_of_line = {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}
    names = {f.name for f in dataclasses.fields(Settings)}
    comments: dict[str, str] = {}
    above: list[str] = []
    for number, line in enumerate(source.splitlines(), 1):
        if line.strip().startswith("#"):
            above.append(comment_of_line.get(number, ""))
            continue
        found = re.match(r" {4}(\w+)\s*:", line)
        if found and found.group(1) in names:
            text = comment_of_line.get(number) or " ".join(above)
            if text:
                comments[found.group(1)] = text
        above = []
    return comments


def _add_settings_flags(parser: argparse.ArgumentParser) -> list[str]:
    """One flag per Settings field (``--grpc-port``...), typed from the field; returns the field names.

    None is every flag's default, so that a flag not given leaves the setting to
    the environment, the config file or the default.
    """
    import dataclasses

    from clipd.server.settings import Settings, field_kind

    comments = _field_comments()
    aliases = {"admin_token": ["--token"], "ray_address": ["--ray"]}
    names = []
    for field in dataclasses.fields(Settings):
        kind = field_kind(field)
        if kind != "bool" and kind not in FLAG_TYPES:
            continue  # no flag spelling for this type: environment or config file only
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        shown = "off" if default == "" else str(default).lower() if isinstance(default, bool) else default
        help_text = f"{comments.get(field.name, '')} (env CLIPD_{field.name.upper()}; default: {shown})".strip()
        flag = "--" + field.name.replace("_", "-")
        options: dict = {"dest": field.name, "default": None, "help": help_text.replace("%", "%%")}
        if kind == "bool":
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = FLAG_TYPES[kind]
            options["metavar"] = {"int": "N", "float": "X"}.get(kind) or next(
                (m for suffix, m in (("_file", "FILE"), ("_dir", "DIR"), ("host", "HOST"), ("token", "TOKEN"))
                 if field.name.endswith(suffix)), "VALUE")
            if field.name in CHOICES:
                options["choices"], options["metavar"] = CHOICES[field.name], None
        parser.add_argument(flag, *aliases.get(field.name, ()), **options)
        names.append(field.name)
    return names


def _serve(args: argparse.Namespace) -> int:
    import errno

    from clipd.server.settings import Settings

    try:
        settings = Settings.load({name: getattr(args, name) for name in args.setting_names},
                                 config_file=args.config)
    except ValueError as e:  # SettingsError: a bad value, a bad file, an invalid combination
        return _error(e, EXIT_SETTINGS)

    from clipd.server import logs

    logs.configure(settings.log_level, settings.log_format)
    from clipd.server.app import serve

    try:
        serve(settings)
    except RuntimeError as e:  # grpc's add_*_port: "Failed to bind to address ..."
        if "bind" not in str(e).lower():
            raise
        _exit_now(_error(f"can't listen for gRPC on {settings.host}:{settings.grpc_port}: "
                         f"{str(e).split(';')[0]}", EXIT_RUNTIME))
    except OSError as e:  # the admin socket's bind, certificate files, the data directory
        if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES) and not e.filename:
            _exit_now(_error(f"can't listen for the admin API on {settings.host}:{settings.admin_port}: "
                             f"{e.strerror or e}", EXIT_RUNTIME))
        _exit_now(_error(e, EXIT_RUNTIME))
    return 0


def _exit_now(status: int) -> None:
    """Exits at once: a server that failed half-way through starting has threads (gRPC, the device worker)
    that can't be stopped cleanly, and the interpreter's shutdown can abort on them. Nothing is lost: the
    store is built to survive a kill."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _demo_updates(examples: int, seed: int) -> dict[str, np.ndarray]:
    """Synthetic per-example updates whose norms spread around 1, so about half get clipped."""
    import numpy as np

    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0.0, 1.0, examples)).astype(np.float32)
    out = {}
    for name, shape in DEMO_LAYERS.items():
        size = math.prod(shape)
        x = rng.standard_normal((examples, *shape)).astype(np.float32) / np.sqrt(size * len(DEMO_LAYERS))
        out[name] = x * scale.reshape((-1,) + (1,) * len(shape))
    return out


def _server_missing() -> ImportError | None:
    """Why the server can't run here (the server extra is not installed), or None if it can."""
    try:
        import clipd.server  # noqa: F401  (its __init__ checks the server extra's packages)
    except ImportError as e:
        return e
    return None


def _serve_unavailable(error: ImportError):
    def run(args: argparse.Namespace) -> int:
        return _error(f"clipd serve: {error}", EXIT_RUNTIME)

    return run


def _demo(args: argparse.Namespace) -> int:
    from clipd.client import Client

    if args.target is None and (missing := _server_missing()) is not None:
        return _error(f"clipd demo without --target starts an embedded server: {missing}; or give --target "
                      "HOST:PORT of a running server", EXIT_RUNTIME)
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
                if args.noise_multiplier is not None:
                    from clipd import private_demo

                    return private_demo.run(client, DEMO_LAYERS, updates, args)
                aggregation = client.create_aggregation(DEMO_LAYERS, policy=args.policy, l2_norm_clip=args.clip)
                try:
                    started = time.perf_counter()
                    report = client.submit(aggregation, updates)
                    result = client.finalize(aggregation)
                    seconds = time.perf_counter() - started
                except BaseException:
                    client.cancel(aggregation)
                    raise
                if args.keep:
                    print(f"kept aggregation {aggregation} on the server (the dashboard shows it; cancel it with"
                          f" the client or DELETE /api/v1/aggregations/{aggregation})")
                else:
                    client.cancel(aggregation)  # the demo leaves nothing behind on the server
            return _report(result, updates, args, report, seconds)
        finally:
            if server is not None:
                server.stop(grace=1.0)


def _reference(updates: dict[str, np.ndarray], args) -> tuple[list, list[int]]:
    """The expected sums and clip counts: clipd.engine's optax APIs when the server extra (JAX) is here,
    else the same rule in numpy (float64): multiplier min(1, C / norm), counted when < 1."""
    import numpy as np

    names = list(DEMO_LAYERS)
    uniform = args.policy == "per_layer_uniform"
    if _server_missing() is None:
        import jax.numpy as jnp

        from clipd import engine

        arrays = [jnp.asarray(updates[n]) for n in names]
        if args.policy == "global":
            clipped_sums, clipped = engine.per_example_global_norm_clip(arrays, args.clip)
            return clipped_sums, [int(clipped)] * len(names)
        clipped_sums, counts = engine.per_example_layer_norm_clip(arrays, args.clip, uniform=uniform)
        return clipped_sums, [int(c) for c in counts]
    grads = [updates[n].astype(np.float64).reshape(len(updates[n]), -1) for n in names]

    def clip(group: list[np.ndarray], bound: float) -> tuple[list[np.ndarray], int]:
        norms = np.sqrt(sum(np.sum(g * g, axis=1) for g in group))
        with np.errstate(divide="ignore", invalid="ignore"):
            multipliers = np.nan_to_num(np.minimum(bound / norms, 1.0), nan=1.0)
        return [multipliers @ g for g in group], int(np.sum(multipliers < 1.0))

    if args.policy == "global":
        sums, count = clip(grads, args.clip)
        return [s.reshape(DEMO_LAYERS[n]) for s, n in zip(sums, names)], [count] * len(names)
    total = sum(g.shape[1] for g in grads)
    ref_sums, ref_counts = [], []
    for g, name in zip(grads, names):
        share = 1.0 / len(grads) if uniform else g.shape[1] / total
        (s,), count = clip([g], args.clip * share**0.5)
        ref_sums.append(s.reshape(DEMO_LAYERS[name]))
        ref_counts.append(count)
    return ref_sums, ref_counts


def _report(result, updates, args, report, seconds) -> int:
    import numpy as np

    names = list(DEMO_LAYERS)
    ref_sums, ref_counts = _reference(updates, args)
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


def _status(args: argparse.Namespace) -> int:
    from clipd import status

    given = args.admin or os.environ.get("CLIPD_ADMIN_URL") or status.DEFAULT_ADMIN
    base = (given if "://" in given else f"http://{given}").rstrip("/")
    if not base.startswith(("http://", "https://")) or base.endswith("//"):
        return _error(f"--admin {given}: give the admin API's URL, http:// or https://, such as {status.DEFAULT_ADMIN}",
                      EXIT_RUNTIME)
    token = args.token or os.environ.get("CLIPD_ADMIN_TOKEN") or None
    context = None
    if base.startswith("https://"):
        import ssl

        try:
            context = ssl.create_default_context(cafile=args.cafile)
        except (OSError, ssl.SSLError) as e:
            return _error(f"can't read --cafile {args.cafile}: {getattr(e, 'strerror', None) or e}", EXIT_RUNTIME)
    try:
        reads = {path: status.read(base, path, token, context, args.timeout) for path in status.STATUS_PATHS}
    except status.AdminError as e:
        return _error(e, EXIT_RUNTIME)
    if args.state:
        listed = reads["/api/v1/aggregations"]
        listed["aggregations"] = [a for a in listed.get("aggregations") or [] if a.get("state") in args.state]
    if args.json:
        print(json.dumps(reads, indent=2))
        return 0
    for line in status.status_lines(base, reads, args.state):
        print(line)
    return 0


def _token(args: argparse.Namespace) -> int:
    """Issues a client token (or a submitter token) with the admin token, and prints it alone on stdout."""
    admin = args.token or os.environ.get("CLIPD_ADMIN_TOKEN")
    if not admin:
        return _error("the admin token is needed to issue a client token: --token or CLIPD_ADMIN_TOKEN", EXIT_RUNTIME)
    if (args.client is None) == (not args.submitter):
        return _error("give --client ID (a client's token) or --submitter (a trusted submitter's)", EXIT_SETTINGS)
    def issue(client) -> str:
        scope = {"aggregation": args.aggregation, "ledger": args.ledger}
        return (client.submitter_token(**scope, ttl=args.ttl) if args.submitter
                else client.client_token(args.client, **scope, ttl=args.ttl))

    token = _with_admin_client(args, admin, issue)
    if isinstance(token, int):
        return token
    print(token)
    return 0


def _with_admin_client(args: argparse.Namespace, token: str | None, call):
    """``call(client)`` on a Client of ``args.target`` (``--cafile``, ``--timeout``) holding ``token``; an exit
    status, with the error printed, if the CA file can't be read or the server refuses."""
    from clipd.client import Client, ClipdError

    root = None
    if args.cafile:
        try:
            with open(args.cafile, "rb") as f:
                root = f.read()
        except OSError as e:
            return _error(f"can't read --cafile {args.cafile}: {e.strerror}", EXIT_RUNTIME)
    try:
        with Client(args.target, token=token, root_certificates=root, retry_timeout=args.timeout,
                    timeout=args.timeout) as client:
            return call(client)
    except ClipdError as e:
        return _error(f"{getattr(e.code, 'name', 'refused')}: {e.details}", EXIT_RUNTIME)


def _audit(args: argparse.Namespace) -> int:
    """Closes a ledger's canary audit (unless --no-close) and prints it; the last line is the result."""
    import numpy as np

    ledger = _with_admin_client(args, args.token or os.environ.get("CLIPD_ADMIN_TOKEN") or None,
                                lambda c: c.ledger(args.ledger) if args.no_close else c.close_audit(args.ledger))
    if isinstance(ledger, int):
        return ledger
    if not ledger.HasField("audit"):
        return _error(f"ledger {args.ledger!r} has no audit", EXIT_RUNTIME)
    audit = ledger.audit
    print(f"ledger {ledger.ledger_id}: {ledger.mechanism} noise, {len(ledger.entries)} releases, epsilon"
          f" {ledger.epsilon:.6g} at delta {ledger.delta:g}")
    print(f"audit: {audit.canaries} canaries held in and {audit.canaries} held out, over {audit.releases} releases;"
          f" {'closed' if audit.closed else 'open (the canaries stay secret until it closes)'}")
    if not audit.closed:
        print(f"audit: ledger={ledger.ledger_id} canaries={audit.canaries} epsilon_lower=open"
              f" epsilon_claimed={audit.epsilon_claimed:.6g} confidence={audit.confidence:g}")
        return 0
    held_in, held_out = np.asarray(audit.in_scores), np.asarray(audit.out_scores)
    print(f"scores: held in median {np.median(held_in):.4g}, held out median {np.median(held_out):.4g}"
          f" (log-likelihood ratios under the claimed noise)")
    print(f"epsilon is at least {audit.epsilon_lower:.4g} with confidence {audit.confidence:g}"
          f" ({audit.method}); {audit.canaries} canaries can show at most {audit.epsilon_ceiling:.4g};"
          f" claimed {audit.epsilon_claimed:.6g}")
    if audit.refuted:
        print("REFUTED: the lower bound passes the claimed epsilon: the releases move more than the ledger's noise"
              " and bound allow (too little noise, or a clip that lets a contribution past its bound)")
    print(f"audit: ledger={ledger.ledger_id} canaries={audit.canaries} epsilon_lower={audit.epsilon_lower:.6g}"
          f" epsilon_claimed={audit.epsilon_claimed:.6g} confidence={audit.confidence:g}")
    return EXIT_REFUTED if audit.refuted else 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("clipd-service")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``clipd`` command line: ``serve`` (one flag per setting) and ``demo``."""
    parser = argparse.ArgumentParser(prog="clipd", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"clipd {_version()}",
                        help="the installed clipd-service's version, then exit")
    sub = parser.add_subparsers(dest="command", required=True)
    missing = _server_missing()
    if missing is None:
        serve = sub.add_parser("serve", help="run the gRPC service and its admin API")
        serve.add_argument("--config", metavar="FILE", default=None,
                           help="TOML file of settings (keys: the names below with underscores, e.g. grpc_port ="
                                " 50051); env CLIPD_CONFIG. Precedence: flags > CLIPD_* variables > file > defaults")
        serve.set_defaults(setting_names=_add_settings_flags(serve))
        serve.set_defaults(run=_serve)
    else:  # the client side only: `clipd serve ...` says what to install, whatever its flags
        serve = sub.add_parser("serve", help="run the service (needs: pip install '.[server]')", add_help=False)
        serve.set_defaults(run=_serve_unavailable(missing), any_arguments=True)
    demo = sub.add_parser("demo", help="stream synthetic updates and check the aggregate")
    demo.add_argument("--target", default=None, help="HOST:PORT of a server (default: start one in-process)")
    demo.add_argument("--token", default=None,
                      help="the server's admin token, if it has one (sent as 'authorization: Bearer TOKEN')")
    demo.add_argument("--examples", type=int, default=2000,
                      help="synthetic examples to stream, of 4 layers (default: 2000)")
    demo.add_argument("--clip", type=float, default=1.0, help="C, the L2 bound each example is clipped to (default: 1)")
    demo.add_argument("--policy", default="global",
                      choices=["global", "per_layer_uniform", "per_layer_proportional"],
                      help="global: the whole example to C; per_layer_*: each layer to its share of C")
    demo.add_argument("--seed", type=int, default=0, help="the synthetic examples' seed (default: 0)")
    demo.add_argument("--keep", action="store_true",
                      help="leave the finalized aggregation on the server (--target) for its dashboard and admin"
                           " API; by default the demo cancels it when it ends")
    demo.add_argument("--retry-timeout", type=float, default=60.0,
                      help="how long to retry an unreachable or restarting server (seconds)")
    private = demo.add_argument_group("differential privacy (R releases on one ledger; see clipd/private_demo.py)")
    private.add_argument("--noise-multiplier", type=float, default=None, metavar="Z",
                         help="release each round's sum with Gaussian noise of stddev Z * C")
    private.add_argument("--sampling-rate", type=float, default=1.0, metavar="Q",
                         help="Poisson sampling: each example joins a round with probability Q")
    private.add_argument("--delta", type=float, default=1e-5, metavar="D",
                         help="the ledger's delta: epsilon is reported at it (default: 1e-5)")
    private.add_argument("--rounds", type=int, default=1, metavar="R",
                         help="private rounds (releases) on the ledger (default: 1)")
    private.add_argument("--max-epsilon", type=float, default=None, metavar="E",
                         help="the ledger's budget: a round it can't afford is refused")
    private.add_argument("--secure-noise", action="store_true",
                         help="a discrete Gaussian on an integer grid from a CSPRNG (OpenDP), accounted by zCDP;"
                              " sampling is then not claimed (a larger, valid epsilon)")
    private.add_argument("--mechanism", choices=["independent", "blt", "banded"], default="independent",
                         help="independent: fresh noise each round; blt or banded: one correlated noise stream"
                              " for the R rounds (DP-FTRL; the ledger keeps its state; sampling not claimed)")
    private.add_argument("--seed-sampling", action="store_true",
                         help="draw each round's sample from --seed (the server's noise stays secure)")
    demo.set_defaults(run=_demo)
    status = sub.add_parser("status", aliases=["ls"], help="list a running server's aggregations and ledgers"
                            " (reads its admin API)",
                            description="The aggregations and privacy ledgers of a running server, read from its"
                                        " admin HTTP API (not gRPC): needs only the standard library.")
    status.add_argument("--admin", metavar="URL", default=None,
                        help=f"the server's admin API (its --admin-port; https when it has a TLS certificate); env"
                             f" CLIPD_ADMIN_URL (default: {DEFAULT_ADMIN})")
    status.add_argument("--token", metavar="TOKEN", default=None,
                        help="the server's admin token, if it has one (sent as 'Authorization: Bearer TOKEN');"
                             " default: env CLIPD_ADMIN_TOKEN")
    status.add_argument("--cafile", metavar="FILE", default=None,
                        help="PEM file of the CA to trust for an https admin API (a private CA); default: the"
                             " system's CAs")
    status.add_argument("--state", action="append", choices=AGGREGATION_STATES, default=None, metavar="STATE",
                        help="list only the aggregations in this state (repeat for several):"
                             f" {', '.join(AGGREGATION_STATES)}")
    status.add_argument("--json", action="store_true",
                        help="print the API's JSON as read (keyed by path) instead of tables")
    status.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                        help="how long to wait for each answer of the admin API (default: 10)")
    status.set_defaults(run=_status)
    token = sub.add_parser("token", help="issue a client's credential (the admin's): client ids it can't choose",
                           description="Prints a client token: its holder submits as --client only, to --aggregation"
                                       " or to every aggregation of --ledger (docs/threat-model.md).")
    _add_admin_client_flags(token)
    scope = token.add_mutually_exclusive_group(required=True)
    scope.add_argument("--aggregation", metavar="ID", default=None, help="the token is for this aggregation only")
    scope.add_argument("--ledger", metavar="ID", default=None,
                       help="the token is for every aggregation of this privacy ledger (a client across rounds)")
    token.add_argument("--client", metavar="ID", default=None, help="the client id its holder submits as")
    token.add_argument("--submitter", action="store_true",
                       help="a trusted submitter's token instead: it may name any client id (a framework's server)")
    token.add_argument("--ttl", type=float, default=None, metavar="SECONDS",
                       help="valid for this long (default: as long as its aggregation and the server's key)")
    token.set_defaults(run=_token)
    audit = sub.add_parser("audit", help="close a ledger's canary audit and print its lower bound on epsilon",
                           description="Closes the ledger's canary audit (admin; later releases carry no canaries)"
                                       " and prints its empirical lower bound on epsilon beside the claimed one."
                                       " The last line: 'audit: ledger=<id> canaries=<n> epsilon_lower=<l>"
                                       " epsilon_claimed=<e> confidence=<c>'. Exit status 3 if the bound passes"
                                       " the claim (docs/privacy.md, 'Canary audits').")
    audit.add_argument("ledger", metavar="LEDGER", help="the ledger's id")
    _add_admin_client_flags(audit)
    audit.add_argument("--no-close", action="store_true",
                       help="print the audit as it stands; an open audit shows its progress only")
    audit.set_defaults(run=_audit)
    return parser


def _add_admin_client_flags(parser: argparse.ArgumentParser) -> None:
    """--target, --token, --cafile and --timeout of a command that calls the server's gRPC API as the admin."""
    parser.add_argument("--target", default="localhost:50051", metavar="HOST:PORT",
                        help="the server's gRPC address (default: localhost:50051)")
    parser.add_argument("--token", metavar="TOKEN", default=None, help="the admin token (default: $CLIPD_ADMIN_TOKEN)")
    parser.add_argument("--cafile", metavar="FILE", default=None,
                        help="PEM file of the CA that signed the server's certificate (TLS)")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                        help="give up on an unreachable server after this long (default: 10)")


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
        from clipd import _process

        _process.tune()  # glibc's malloc and OpenBLAS's threads, before numpy loads (clipd/_process.py)
        _process.name_threads()  # its native threads named as its Python threads (top -H shows which is busy)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
