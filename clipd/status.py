"""``clipd status``: a running server's load, aggregations and ledgers, read from its admin HTTP API.

Only the standard library (urllib): it works with the client-side install, which has no FastAPI.

>>> print("\\n".join(table(["ID", "N"], [["a", "1"], ["bb", "22"]], right=(1,))))
ID   N
a    1
bb  22
"""

from __future__ import annotations

import json
import time

DEFAULT_ADMIN = "http://127.0.0.1:8080"  # the admin API of `clipd serve` on this machine
AGGREGATION_STATES = ("warming_up", "open", "finalizing", "finalized", "cancelled", "failed")

STATUS_PATHS = ("/readyz", "/api/v1/server", "/api/v1/aggregations", "/api/v1/ledgers", "/api/v1/streams")


class AdminError(Exception):
    """One line saying why the admin API could not be read, and what to try."""


def read(base: str, path: str, token: str | None, context, timeout: float) -> dict:
    """``GET base + path`` as JSON (a 503 of /readyz too: its body says why), or AdminError."""
    import http.client
    import ssl
    import urllib.error
    import urllib.request

    try:
        request = urllib.request.Request(base + path, headers={"Accept": "application/json"})
    except ValueError as e:
        raise AdminError(f"--admin {base}: {e}; give a URL such as {DEFAULT_ADMIN}") from None
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
                body = response.read()
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise AdminError(f"the admin API at {base} needs the admin token: give it with --token TOKEN or"
                                  " CLIPD_ADMIN_TOKEN") from None
            if e.code == 403:
                raise AdminError(f"the admin API at {base} refused the token given (403): give the server's"
                                  " admin token with --token or CLIPD_ADMIN_TOKEN") from None
            if not (e.code == 503 and path == "/readyz"):
                raise AdminError(f"{base}{path} answered HTTP {e.code} {e.reason}: is {base} clipd's admin API"
                                  " (clipd serve --admin-port)?") from None
            body = e.read()
    except AdminError:
        raise
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise AdminError(f"can't verify the certificate of {base}: {reason.verify_message or reason}; give"
                              " the CA that signed it with --cafile FILE") from None
        if isinstance(reason, ssl.SSLError):
            raise AdminError(f"no TLS with {base}: {reason}; is it http:// rather than https://?") from None
        raise AdminError(f"can't reach the admin API at {base} ({getattr(reason, 'strerror', None) or reason}):"
                          " is clipd serve running there with its admin API on (--admin-port)? Give its URL"
                          " with --admin URL or CLIPD_ADMIN_URL") from None
    except (TimeoutError, http.client.HTTPException, OSError) as e:
        raise AdminError(f"no answer from the admin API at {base} ({e or type(e).__name__}): is {base} clipd's"
                          " admin API (clipd serve --admin-port), and http or https as it serves?") from None
    try:
        data = json.loads(body)
    except ValueError:
        raise AdminError(f"{base}{path} did not answer JSON: is {base} clipd's admin API"
                          " (clipd serve --admin-port)?") from None
    if not isinstance(data, dict):
        raise AdminError(f"{base}{path} did not answer a JSON object: is {base} clipd's admin API?")
    return data


def status_lines(base: str, reads: dict[str, dict], states: list[str] | None) -> list[str]:
    """The server line, the aggregations' table, the ledgers' table and (if any) the buffered streams' table of
    ``clipd status``."""
    ready, server = reads["/readyz"], reads["/api/v1/server"]
    listed = reads["/api/v1/aggregations"]
    ledgers = reads["/api/v1/ledgers"].get("ledgers") or []
    streams = server.get("streams") or ready.get("streams") or {}
    buffered = server.get("buffered_bytes") or ready.get("buffered_bytes") or {}
    parts = ["ready" if ready.get("ready") else "NOT READY (" + "; ".join(ready.get("reasons") or ["?"]) + ")"]
    if isinstance(server.get("uptime_seconds"), int | float):
        parts.append(f"up {age(server['uptime_seconds'])}")
    parts += [f"Submit streams {streams.get('active', '?')}/{streams.get('limit', '?')}"
              + (f" ({streams['refused']} refused)" if streams.get("refused") else ""),
              f"buffered {size(buffered.get('used'))} of {size(buffered.get('limit'))}"]
    devices = server.get("devices") or []
    kinds: dict[str, int] = {}
    for device in devices:
        kind = str(device.get("kind") or device.get("platform") or "?")
        kinds[kind] = kinds.get(kind, 0) + 1
    if kinds:
        steps = sum(int(d.get("steps") or 0) for d in devices)
        parts.append("devices " + ", ".join(f"{n} x {k}" for k, n in kinds.items()) + f" ({steps} steps)")
    elif server.get("device_kind") or listed.get("device_kind"):
        parts.append(f"device {server.get('device_kind') or listed.get('device_kind')}")
    lines = [f"server {base}: " + ", ".join(parts)]
    processes = server.get("shard_processes") or []
    if processes:
        described = []
        for p in processes:
            state = "serving" if p.get("serving") else "alive, not serving" if p.get("alive") else "DOWN"
            own = p.get("streams") or {}
            if own:
                state += f", streams {own.get('active', '?')}/{own.get('limit', '?')}"
            restarts = int(p.get("restarts") or 0)
            described.append(f"#{p.get('index', '?')} {state}" + (f", restarted {restarts}x" if restarts else ""))
        restarted = sum(int(p.get("restarts") or 0) for p in processes)
        lines.append(f"shard processes: {len(processes)}, {restarted} restart{'s' * (restarted != 1)}: "
                     + "; ".join(described))
    if listed.get("privacy_debug_notice"):
        lines.append(str(listed["privacy_debug_notice"]))
    lines.append("")
    aggregations = listed.get("aggregations") or []
    now = listed.get("now_unix_seconds") or time.time()  # the server's clock, which the ages are of
    if aggregations:
        lines.append(f"{len(aggregations)} aggregation{'s' * (len(aggregations) != 1)}")
        rows = []
        for a in aggregations:
            privacy = a.get("privacy") or {}
            withheld = bool(privacy) and a.get("examples") is None  # raw statistics withheld, never a made-up 0
            created = a.get("created_unix_seconds")
            examples, clipped = a.get("examples"), a.get("clipped")
            if withheld:
                numbers = ["withheld"] * 3
            else:
                share = f"{100.0 * clipped / examples:.1f}%" if examples and clipped is not None else "-"
                numbers = [cell(examples), cell(a.get("batches")), share]
            rows.append([str(a.get("aggregation_id")), str(a.get("state")),
                         time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created else "-",
                         age(now - created) if created else "-", *numbers, privacy.get("ledger_id") or "-"])
        lines += table(["ID", "STATE", "CREATED", "AGE", "EXAMPLES", "BATCHES", "CLIPPED", "LEDGER"], rows,
                        right=(4, 5, 6))
        lines += [f"{a.get('aggregation_id')} failed: {a['failure_reason']}" for a in aggregations
                  if a.get("state") == "failed" and a.get("failure_reason")]
    elif states:
        lines.append(f"no aggregations in state {' or '.join(states)}")
    else:
        lines.append("no aggregations: make one with `clipd demo --keep --target HOST:GRPC_PORT` or the client"
                     " library (clipd.client.Client.create_aggregation)")
    lines.append("")
    if ledgers:
        lines.append(f"{len(ledgers)} privacy ledger{'s' * (len(ledgers) != 1)}")
        rows = []
        for ledger in ledgers:
            stream = ledger.get("stream") or {}
            rows.append([str(ledger.get("ledger_id")), str(ledger.get("mechanism") or "independent"),
                         str(ledger.get("unit") or "example"),
                         (ledger.get("client_ids") or "-").replace("_", "-"),
                         cell(ledger.get("epsilon")), cell(ledger.get("max_epsilon")), cell(ledger.get("delta")),
                         cell(len(ledger.get("entries") or [])),
                         f"{stream.get('left', '?')} of {stream.get('releases', '?')}" if stream else "-",
                         audit_cell(ledger.get("audit"))])
        lines += table(["ID", "MECHANISM", "UNIT", "CLIENT IDS", "EPSILON", "MAX EPSILON", "DELTA", "RELEASES",
                        "STREAM LEFT", "AUDIT"], rows, right=(4, 5, 6, 7))
    else:
        lines.append("no privacy ledgers")
    streams = (reads.get("/api/v1/streams") or {}).get("streams") or []
    if streams:
        lines += ["", f"{len(streams)} buffered stream{'s' * (len(streams) != 1)}"]
        rows = []
        for stream in streams:
            buffer, staleness = stream.get("buffer") or {}, stream.get("staleness") or {}
            rows.append([str(stream.get("stream_id")), str(stream.get("state")), cell(stream.get("version")),
                         f"{cell(buffer.get('filled'))}/{cell(buffer.get('size'))}",
                         f"{float(stream.get('releases_per_minute') or 0):.1f}", cell(staleness.get("mean")),
                         str(stream.get("ledger_id") or "-"), cell(stream.get("ledger_epsilon"))])
        lines += table(["ID", "STATE", "VERSION", "BUFFER", "RELEASES/MIN", "MEAN STALENESS", "LEDGER", "EPSILON"],
                       rows, right=(2, 3, 4, 5, 7))
        lines += [f"{s.get('stream_id')} stopped: {s['reason']}" for s in streams
                  if s.get("state") == "stopped" and s.get("reason")]
    return lines


def table(header: list[str], rows: list[list[str]], right: tuple[int, ...] = ()) -> list[str]:
    """Columns two spaces apart, each as wide as its widest cell; the ``right`` ones right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            .rstrip() for row in [header, *rows]]


def audit_cell(audit: dict | None) -> str:
    """A ledger's canary audit: ``-`` (none), ``open, N canaries`` or ``>= LOWER (of CLAIMED) at 95%``, marked
    ``REFUTED`` when the bound passes the claim."""
    if not audit:
        return "-"
    if not audit.get("closed"):
        return f"open, {audit.get('canaries')} canaries"
    said = (f">= {cell(audit.get('epsilon_lower'))} (claimed {cell(audit.get('epsilon_claimed'))})"
            f" at {100 * float(audit.get('confidence') or 0):g}%")
    return f"REFUTED {said}" if audit.get("refuted") else said


def cell(value: object) -> str:
    """A number as the table shows it: integers whole, floats to 6 significant digits; "inf" as JSON has it."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def size(n: object) -> str:
    if not isinstance(n, int | float):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "?"


def age(seconds: float) -> str:
    """``42s``, ``3m12s``, ``2h05m``, ``4d03h``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
