"""Smoke runs of the benchmark scripts: they run to the end and print their closing ratio line."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import background
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each smoke run: its command and its timeout (s).
RUNS = {
    "service": ([sys.executable, str(ROOT / "benchmarks" / "service.py"), "--quick"], 120),
    "engine": ([sys.executable, str(ROOT / "benchmarks" / "engine.py"), "--quick"], 180),
    "privacy": ([sys.executable, str(ROOT / "benchmarks" / "privacy.py"), "--quick"], 300),
    "scale": ([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--quick"], 300),
    "round": ([sys.executable, str(ROOT / "benchmarks" / "round.py"), "--clients", "100", "--client-processes", "2", "--repeats", "1"], 300),
    "sinks": ([sys.executable, str(ROOT / "benchmarks" / "round.py"), "--sinks", "--clients", "40", "--client-processes", "2", "--repeats", "1"], 300),
    "training": ([sys.executable, str(ROOT / "benchmarks" / "training.py"), "--quick"], 300),
    "large": ([sys.executable, str(ROOT / "benchmarks" / "large.py"), "--quick"], 120),
    "audit": ([sys.executable, str(ROOT / "benchmarks" / "audit.py"), "--quick"], 120),
}
TESTS = {"test_service_benchmark_quick_run": "service", "test_engine_benchmark_quick_run": "engine",
         "test_privacy_benchmark_quick_run": "privacy", "test_scale_benchmark_quick_run": "scale",
         "test_round_benchmark_small_round_is_exact_without_errors": "round",
         "test_round_benchmark_compares_bare_sync_and_aio_sinks": "sinks",
         "test_training_benchmark_quick_run": "training", "test_large_benchmark_quick_run": "large",
         "test_audit_benchmark_quick_run": "audit"}


def _job(name: str) -> background.Job:
    command, timeout = RUNS[name]
    return background.Job(f"benchmark:{name}", functools.partial(background.run_process, command, timeout, cwd=ROOT))


def background_jobs(items, config) -> list[background.Job]:
    """The selected smoke runs, started once the tests are collected, one at a time beside the tests (they check
    output, not speed): tests/background.py."""
    return [_job(name) for name in dict.fromkeys(TESTS[item.originalname] for item in items
                                                if item.originalname in TESTS)]


@pytest.fixture(scope="module")
def smoke_runs(request):
    """The selected smoke runs (started beside the earlier tests): those not yet started run now, two at a time,
    on a second thread and as they are waited for: each is a subprocess that waits on its own servers and
    clients part of the time, so two overlap on two cores."""
    wanted = dict.fromkeys(TESTS[item.originalname] for item in request.session.items
                           if item.module is request.module and item.originalname in TESTS)
    jobs = {name: background.job(f"benchmark:{name}", functools.partial(_job, name)) for name in wanted}
    background.run_in_thread(jobs.values(), "clipd-smoke-runs")
    return jobs


def _ratio_of_printed(ratio: float, numerator: float, denominator: float, step: float = 0.01) -> bool:
    """Whether ``ratio`` (printed to 0.01) can be ``numerator / denominator`` before both were rounded to ``step``:
    the bound is the rounding carried through the division, so a ratio of 25 over a 1.5 ms base is allowed 0.17."""
    exact = numerator / denominator
    carried = exact * (step / 2 / numerator + step / 2 / denominator) + 0.0051
    return abs(ratio - exact) <= carried


def _positive(text: str) -> float:
    value = float(text.replace(",", ""))
    assert value > 0 and value != float("inf"), text
    return value


def test_service_benchmark_quick_run(smoke_runs):
    out = smoke_runs["service"].result()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()

    # Throughput table: durable, memory and bare ex/s (and GB/s), then dur/mem and mem/bare.
    header = next(line for line in lines if line.startswith("case "))
    columns = [part.split() for part in header.split("|")]
    assert columns[1:] == [["durable", "ex/s", "GB/s"], ["memory", "ex/s", "GB/s"], ["bare", "ex/s", "GB/s"],
                           ["dur/mem"], ["mem/bare"]], header
    cases = ("small/1-per-msg", "small/batched", "large")
    rows = {line.split()[0]: line for line in lines if "|" in line and line.split()[0] in cases}
    assert set(rows) == set(cases), out.stdout
    ratios = {}
    for name, row in rows.items():
        parts = [part.split() for part in row.split("|")]
        assert len(parts) == 6, row
        for rate, gbs in parts[1:4]:
            _positive(rate)
            _positive(gbs)
        (durable_vs_memory,), (memory_vs_bare,) = parts[4:]
        ratios[name] = (_positive(durable_vs_memory), _positive(memory_vs_bare))

    # Acknowledgement latency: count, median and p90 ms, back-to-back and after idle, per server.
    latency = {line.split()[0]: line for line in lines if line.split()[:2] in (["durable", "|"], ["memory", "|"])}
    assert set(latency) == {"durable", "memory"}, out.stdout
    for row in latency.values():
        parts = [part.split() for part in row.split("|")]
        assert len(parts) == 3 and all(len(p) == 3 for p in parts[1:]), row
        for count, median, p90 in parts[1:]:
            assert int(count) > 0, row
            assert _positive(p90) >= _positive(median), row

    # The last two lines: the smaller ratio of small/batched and large, machine-readable.
    durable_line, last = lines[-2:]
    match = re.fullmatch(r"durable_vs_memory_ratio=(\d+\.\d{3})", durable_line)
    assert match, out.stdout
    assert abs(float(match[1]) - min(ratios[n][0] for n in ("small/batched", "large"))) <= 0.0015, out.stdout
    match = re.fullmatch(r"service_vs_bare_grpc_ratio=(\d+\.\d{3})", last)
    assert match, out.stdout
    assert abs(float(match[1]) - min(ratios[n][1] for n in ("small/batched", "large"))) <= 0.0015, out.stdout
    _positive(match[1])
    assert "durable data_dir" in out.stdout and "memory data_dir 'memory'" in out.stdout, out.stdout


def test_engine_benchmark_quick_run(smoke_runs):
    out = smoke_runs["engine"].result()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 new compilations" in out.stdout
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"engine_vs_optax_median_ratio=\d+\.\d{3}", last), out.stdout


def test_privacy_benchmark_quick_run(smoke_runs):
    out = smoke_runs["privacy"].result()
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 3 and line.strip()[0].isdigit()]
    assert len(rows) == 3  # one Finalize size, two ledger lengths
    for row in rows:
        assert _positive(row[-1])
    noise = [line.split("|") for line in out.stdout.splitlines() if line.count("|") == 4 and line.strip()[0].isdigit()]
    assert len(noise) == 1 and noise[0][0].strip() == "16,384", out.stdout  # default against secure noise
    default, secure_s, ratio = (_positive(v) for v in noise[0][1:4])
    assert abs(ratio - secure_s / default) <= 0.01 * ratio + 0.1, out.stdout
    assert out.stdout.strip().splitlines()[-1] == f"noise: secure_over_default={ratio:.1f}", out.stdout


def test_scale_benchmark_quick_run(smoke_runs):
    out = smoke_runs["scale"].result()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    header = next(line for line in lines if line.startswith("mode "))
    assert [" ".join(part.split()) for part in header.split("|")][1:] == [
        "wall s", "GB/s", "CPU-s/GB", "control CPU-s/GB", "max share", "vs bare gRPC"], header
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in lines if "|" in line and not line.startswith("mode")}
    assert set(rows) == {"loopback TCP (reference)", "bare gRPC, 1 process", "bare gRPC, 2 processes", "one process",
                         "1 shard process", "2 shard processes"}, rows
    for row in rows.values():
        for value in row[:3]:
            _positive(value)
    match = re.fullmatch(r"dataplane: control_cpu_per_gb=(\d+\.\d{3}) cpu_per_gb_ratio_2v1=(\d+\.\d{3})"
                         r" max_process_share_2=(\d+\.\d{3})", lines[-1])
    assert match, out.stdout
    two, one = rows["2 shard processes"], rows["one process"]
    assert abs(float(match[1]) - float(two[3])) <= 0.0015 + 0.01 * float(match[1]), out.stdout
    expected = float(two[2]) / float(one[2])
    assert abs(float(match[2]) - expected) <= 0.01 * expected, out.stdout
    assert 0 < float(match[3]) <= 1 and abs(float(match[3]) - float(two[4])) <= 0.006, out.stdout
    assert abs(float(two[5]) - float(two[1]) / float(rows["bare gRPC, 2 processes"][1])) <= 0.01 * float(two[5]) + 0.002


def test_round_benchmark_small_round_is_exact_without_errors(smoke_runs):
    """The cross-device round in small: 100 clients, one update each, every one summed exactly, no error."""
    out = smoke_runs["round"].result()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in lines if "|" in line and "wall" not in line}
    assert set(rows) == {"round", "8 clients"}, out.stdout
    match = re.fullmatch(r"round: clients=100 exact=True errors=0 throughput_ratio=(\d+\.\d{3})"
                         r" retries_per_client=(\d+\.\d{3}) server_ms_per_client=(\d+\.\d{2})", lines[-1])
    assert match, out.stdout
    expected = float(rows["round"][1]) / float(rows["8 clients"][1])
    assert abs(float(match[1]) - expected) <= 0.02 * expected + 0.002, out.stdout
    assert float(match[2]) == int(rows["round"][5]) / 100 and float(match[3]) == float(rows["round"][3]), out.stdout
    # The server's CPU from the start, split by the part of it that spent it, adds up to the whole.
    split = next(line for line in lines if line.strip().startswith("round ") and "gRPC" in line).split()[1:]
    parts = dict(zip(split[::2], map(float, split[1::2])))
    assert set(parts) == {"gRPC", "handlers", "summing", "durability", "control", "other"}, out.stdout
    # (whole processes are counted in 10 ms ticks, threads in ns: three processes' ticks over 100 clients, 0.3 ms)
    assert abs(sum(parts.values()) - float(match[3])) <= 0.4 + 0.02 * float(match[3]), out.stdout


def test_round_benchmark_compares_bare_sync_and_aio_sinks(smoke_runs):
    """``round.py --sinks``: the gRPC runtime alone, sync and grpc.aio, each acknowledging every message."""
    out = smoke_runs["sinks"].result()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in lines if "|" in line and "wall" not in line}
    assert set(rows) == {"sync round", "sync 8 clients", "aio round", "aio 8 clients"}, out.stdout
    assert all(row[4].strip() == "0" and row[6].strip() == "True" for row in rows.values()), out.stdout  # no errors
    rate = {mode: float(row[1]) for mode, row in rows.items()}  # GB/s, printed to 1 MB/s: under 1% off at 0.1 GB/s
    match = re.fullmatch(r"sinks: clients=40 sync_round_ratio=(\d+\.\d{3}) aio_round_ratio=(\d+\.\d{3})"
                         r" aio_over_sync_round=(\d+\.\d{3})", lines[-1])
    assert match, out.stdout
    for got, expected in zip(match.groups(), (rate["sync round"] / rate["sync 8 clients"],
                                              rate["aio round"] / rate["aio 8 clients"],
                                              rate["aio round"] / rate["sync round"])):
        assert abs(float(got) - expected) <= 0.02 * expected + 0.002, out.stdout


def test_training_benchmark_quick_run(smoke_runs):
    """benchmarks/training.py: Opacus' local step beside clipd's (a real `clipd serve`), and where it goes."""
    out = smoke_runs["training"].result()
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in out.stdout.splitlines() if "|" in line}
    ms = {}
    for name in ("opacus (all local)", "trainer's part alone (grads, SGD)", "floor: trainer's part + bare round trip",
                 "clipd, one call (default)", "clipd, separate calls, pipelined", "clipd, separate calls, sequential"):
        ms[name] = _positive(rows[name][0])
        # each row's ratio is its ms over opacus' (both printed to 0.01 ms)
        assert _ratio_of_printed(float(rows[name][1]), ms[name], _positive(rows["opacus (all local)"][0])), rows[name]
    for phase in ("create", "submit (until acknowledged)", "finalize (with the release)"):
        assert _positive(rows[f"separate calls, sequential, client: {phase}"][0])
    last = out.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"training: opacus_ms=(\S+) clipd_ms=(\S+) grads_ms=(\S+) overhead_ms=(\S+) service_ms=(\S+)"
                         r" floor_ms=(\S+) vs_opacus=(\S+) vs_floor=(\S+)", last)
    assert match, out.stdout
    opacus, clipd, grads, overhead, service, floor, vs_opacus, vs_floor = map(float, match.groups())
    assert (opacus, clipd, grads, floor) == (ms["opacus (all local)"], ms["clipd, one call (default)"],
                                             ms["trainer's part alone (grads, SGD)"],
                                             ms["floor: trainer's part + bare round trip"])
    assert overhead == pytest.approx(clipd - opacus, abs=0.011) and service == pytest.approx(clipd - grads, abs=0.011)
    assert _ratio_of_printed(vs_opacus, clipd, opacus) and _ratio_of_printed(vs_floor, clipd, floor), last
    assert floor > grads


def test_large_benchmark_quick_run(smoke_runs):
    """benchmarks/large.py --quick: 4 whole-model updates (P = 2^22) on the memory and durable stores, and the same
    bytes as 1 MiB examples; every row exact, without a reconnect; the ratios recomputed from the rows."""
    out = smoke_runs["large"].result()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    header = next(line for line in lines if line.startswith("case "))
    assert [" ".join(part.split()) for part in header.split("|")] == [
        "case", "store", "clock", "params", "examples", "clipped", "submit s", "finalize s", "GB/s", "peak/update",
        "reconnects", "errors", "exact"], header
    rows = {}
    for line in lines:
        parts = [part.strip() for part in line.split("|")]
        if len(parts) == 13 and parts[0] in ("large", "1 MiB"):
            rows[parts[0], parts[1], parts[2]] = parts
    assert set(rows) == {("large", "memory", "create"), ("large", "durable", "create"), ("1 MiB", "memory", "create"),
                         ("large", "memory", "open")}, out.stdout
    params = 1 << 22
    gbps, peak, submit_seconds = {}, {}, {}
    for key, (case, _store, _clock, p, examples, clipped, submit_s, _finalize_s, rate, over, reconnects, errors,
              exact) in rows.items():
        assert int(p) == params, key
        # one update per client, or P / 262,144 examples of 1 MiB each; two of the four clients' clipped
        assert (int(examples), int(clipped)) == ((4, 2) if case == "large" else (64, 32)), (key, out.stdout)
        assert reconnects == "0" and errors == "0", (key, out.stdout)
        match = re.fullmatch(r"True \((\d\.\de[-+]\d\d)\)", exact)
        assert match and float(match[1]) <= 1e-6, (key, out.stdout)
        seconds = submit_seconds[key] = _positive(submit_s)
        gbps[key], peak[key] = _positive(rate), _positive(over)
        expected = 4 * params * 4 / seconds / 1e9  # 4 clients x P float32, over the submit seconds
        assert abs(gbps[key] - expected) <= 0.02 * expected + 0.002, (key, out.stdout)
    memory, durable = gbps["large", "memory", "create"], gbps["large", "durable", "create"]
    small, at_open = gbps["1 MiB", "memory", "create"], gbps["large", "memory", "open"]
    match = re.fullmatch(rf"P={params}: memory_over_small=(\d+\.\d{{3}}) durable_over_memory=(\d+\.\d{{3}})", lines[-2])
    assert match, out.stdout
    # The same bytes in every row, so a rate ratio is the inverse ratio of the submit seconds (printed to the
    # millisecond: far finer than a GB/s printed to three decimals on a slow machine).
    seconds = {key: submit_seconds[key] for key in (("large", "memory", "create"), ("large", "durable", "create"),
                                                       ("1 MiB", "memory", "create"))}
    ratios = (seconds["1 MiB", "memory", "create"] / seconds["large", "memory", "create"],
              seconds["large", "memory", "create"] / seconds["large", "durable", "create"])
    for got, expected in zip(match.groups(), ratios):
        assert abs(float(got) - expected) <= 0.02 * expected + 0.002, out.stdout
    match = re.fullmatch(r"large: params=(\d+) gbps_memory=(\d+\.\d{3}) gbps_durable=(\d+\.\d{3})"
                         r" gbps_small=(\d+\.\d{3}) peak_over_update=(\d+\.\d{3})"
                         r" gbps_memory_from_open=(\d+\.\d{3})", lines[-1])
    assert match and int(match[1]) == params, out.stdout
    for got, expected in zip(match.groups()[1:], (memory, durable, small, max(peak["large", "memory", "create"],
                                                                                 peak["large", "durable", "create"]),
                                                   at_open)):
        assert _positive(got) == expected, out.stdout


def test_audit_benchmark_quick_run(smoke_runs):
    """benchmarks/audit.py --quick: a round's cost with and without an audit; the bound an audit reaches against
    its claim, sound, with every contribution bounded at 10 C and with a tenth of the noise (both reach the
    ceiling); a stream's audit state."""
    out = smoke_runs["audit"].result()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    cost = [line for line in lines if line.strip().startswith("16,384 |")]
    assert len(cost) == 1, out.stdout
    params, canaries, private, audited, ratio, *_ = (p.strip() for p in cost[0].split("|"))
    assert canaries == "100" and _positive(audited) / _positive(private) == pytest.approx(_positive(ratio), rel=0.01)
    power = [line for line in lines if line.strip().startswith("1 |")]
    assert len(power) == 1, out.stdout
    z, n, releases, claimed, lower, ceiling, ratio, clip, clip_refuted, noise, refuted = (
        p.strip() for p in power[0].split("|"))
    assert (n, releases, clip_refuted, refuted) == ("100", "1", "0/1", "0/1")  # claimed 4.7: past 100 canaries' reach
    assert 0 <= float(lower) < _positive(claimed)
    assert float(clip) == pytest.approx(_positive(ceiling), abs=0.01)
    assert float(noise) == pytest.approx(_positive(ceiling), abs=0.01)
    assert any(line.startswith("cost: audited_over_private=") for line in lines)
    assert any(line.startswith("power: sound_max_lower_over_claimed=") for line in lines)
    assert len([line for line in lines if line.startswith("stream: state_bytes=")]) == 2
