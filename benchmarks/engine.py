"""Engine benchmark: our fused clip-and-sum step against optax, in one process.

What is measured, for every row (B examples, P parameters in K layers of
near-equal size, random float32 normal data):

  ours_g   ``ClipAccumulator.update`` with a GLOBAL bound (state donated, rebound
           every call), bound = median example norm (about half the examples clip);
  optax_g  ``jax.jit(optax.per_example_global_norm_clip)`` on the same arrays;
  ours_l   ``ClipAccumulator.update`` with a PER_LAYER_UNIFORM bound, chosen so
           that about half of the (example, layer) pairs clip;
  optax_l  ``jax.jit(optax.per_example_layer_norm_clip(grads, C, uniform=True))``;
  floor    one plain numpy pass over the same bytes (``x.max()``: on these
           machines the fastest single-threaded one-pass numpy read; ``x.sum()``
           is pairwise and slower, ``np.add.reduce(x, axis=0)`` writes a row).

Throughput is reported as GB/s of input consumed (B * P * 4 bytes / time);
``g/opt`` and ``l/opt`` are ours/optax throughput ratios (> 1: we are faster);
``g/flr`` and ``l/flr`` are our throughput over the floor's.

How: the data of one (B, P) is drawn once into one 64-byte-aligned numpy buffer
(each layer a contiguous (B, n_k) slice of it, so the floor reads exactly the
bytes the layers hold) and handed to JAX with ``jax.device_put`` (zero-copy on
the CPU) before any timing; rows with the same (B, P) and different K view the
same bytes. Each function is compiled and warmed up, then one measurement is
``time.perf_counter`` around enough calls (each followed by
``jax.block_until_ready``) to last >= 50 ms, divided by the call count. The
methods of a row are measured interleaved, ``--repeats`` times; the table shows
medians.

After the table, a compilation check: one accumulator with batch buckets
1, 2, 4, ..., 256 (batches padded to the next bucket, padding rows masked off)
is warmed up on every bucket, then fed every batch size 1..256; the number of
step programs compiled after the warm-up must be 0.

Then the XLA:CPU tricks (``clipd/engine/_xla_cpu.py``), each with and without:
for every (B, P, K) of the grid, ``ClipAccumulator.update`` with a GLOBAL bound
(as ``ours_g``; B also 1, as the server's one-row steps) with all tricks on,
with one trick off at a time, and with all off (``none``), measured
interleaved as above but in a shuffled order each repeat. A row shows median
microseconds per step with the trick and without it, and ``ratio``, the median
over repeats of without / with measured in the same repeat (> 1: the trick
buys that much); a summary row per trick gives the median ratio over the grid
and the largest. With one layer (K = 1) ``shared_sum_buffers`` compiles to
the same program on and off: its K = 1 ratios show the noise.

The last line is ``engine_vs_optax_median_ratio=<x>``: the median over all rows
of both ratios (global and per-layer).

Run:  python benchmarks/engine.py              (full run, ~4-6 minutes on 2 cores)
      python benchmarks/engine.py --repeats 5  (fewer repeats, faster, noisier)
      python benchmarks/engine.py --only tricks (the tricks table only)
      python benchmarks/engine.py --only tricks --batches 16 --params 10000 --layer-counts 8  (one row)
      python benchmarks/engine.py --quick      (tiny smoke run, ~15 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax

from clipd.engine import BoundKind, ClipAccumulator, ClipPolicy, LayerSpec, Tricks

ALIGN = 64  # bytes: what jax.device_put needs to alias a host buffer instead of copying it
FLOAT_ALIGN = ALIGN // 4


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run covers."""

    batches: tuple[int, ...]
    params: tuple[int, ...]
    layer_counts: tuple[int, ...]
    repeats: int
    min_measure_s: float  # each measurement lasts at least this long
    compile_max_batch: int  # largest bucket of the compilation check
    trick_batches: tuple[int, ...]  # the B values of the tricks table (the server also runs 1-row steps)


FULL = Settings((16, 256), (10_000, 1_000_000), (1, 8, 64), 15, 0.05, 256, (1, 16, 256))
QUICK = Settings((16,), (10_000,), (1, 8), 3, 0.005, 8, (16,))


@dataclasses.dataclass
class Row:
    """One line of the table: median seconds per call of each method."""

    batch: int
    params: int
    layers: int
    clip_fraction_global: float
    clip_fraction_layer: float
    seconds: dict[str, float]

    def gbps(self, method: str) -> float:
        return self.batch * self.params * 4 / self.seconds[method] / 1e9

    @property
    def ratio_global(self) -> float:
        return self.seconds["optax_g"] / self.seconds["ours_g"]

    @property
    def ratio_layer(self) -> float:
        return self.seconds["optax_l"] / self.seconds["ours_l"]


# ----------------------------------------------------------------------------- data


def aligned_empty(count: int, dtype=np.float32) -> np.ndarray:
    """A 1-d array of ``count`` items whose data starts on a 64-byte boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(count * itemsize + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + count * itemsize].view(dtype)


def layer_sizes(params: int, layers: int) -> list[int]:
    """``layers`` sizes that differ by at most one and sum to ``params``."""
    base, extra = divmod(params, layers)
    return [base + (k < extra) for k in range(layers)]


def layer_views(flat: np.ndarray, batch: int, sizes: Sequence[int]) -> list[np.ndarray]:
    """Contiguous, 64-byte-aligned (batch, n_k) views of consecutive slices of ``flat``."""
    views, offset = [], 0
    for n in sizes:
        views.append(flat[offset : offset + batch * n].reshape(batch, n))
        offset += -(-batch * n // FLOAT_ALIGN) * FLOAT_ALIGN  # next slice starts aligned
    return views


def flat_length(batch: int, params: int, max_layers: int) -> int:
    """Floats needed for the layer views of up to ``max_layers`` layers (aligned slices pad a little)."""
    return batch * params + FLOAT_ALIGN * max_layers


def random_flat(batch: int, params: int, max_layers: int, rng: np.random.Generator) -> np.ndarray:
    """One aligned buffer of standard normal float32 data, big enough for up to ``max_layers`` layers."""
    flat = aligned_empty(flat_length(batch, params, max_layers))
    rng.standard_normal(dtype=np.float32, out=flat)
    return flat


def to_device(arrays: Sequence[np.ndarray]) -> list[jax.Array]:
    """``jax.device_put`` each array; on the CPU, aligned arrays are aliased, not copied."""
    return [jax.device_put(x) for x in arrays]


def is_zero_copy(host: np.ndarray, device: jax.Array) -> bool:
    try:
        return device.unsafe_buffer_pointer() == host.ctypes.data
    except Exception:  # noqa: BLE001 - not every backend exposes the pointer
        return False


def median_bounds(views: Sequence[np.ndarray]) -> tuple[float, float]:
    """(C_global, C_layer): about half of the examples / (example, layer) pairs clip.

    C_global is the median example norm; with PER_LAYER_UNIFORM every layer is
    bounded by C_layer / sqrt(K), so C_layer is sqrt(K) times the median layer norm.
    """
    layer_sq = np.stack([np.einsum("ij,ij->i", x, x) for x in views])
    c_global = float(np.median(np.sqrt(layer_sq.sum(axis=0))))
    c_layer = float(np.median(np.sqrt(layer_sq)) * math.sqrt(len(views)))
    return c_global, c_layer


# ----------------------------------------------------------------------------- methods


class AccumulatorStep:
    """A callable that runs one accumulator update, rebinding the donated state."""

    def __init__(self, specs, policy, batch, valid, tricks: Tricks = Tricks()) -> None:  # noqa: B008 (immutable)
        self.acc = ClipAccumulator(specs, policy, tricks)
        self.state = self.acc.init()
        self.batch, self.valid = batch, valid

    def __call__(self) -> None:
        self.state = self.acc.update(self.state, self.batch, self.valid)
        jax.block_until_ready(self.state)

    def clip_fraction(self) -> float:
        """Fraction of (example, clip group) pairs clipped so far."""
        counts = np.asarray(self.state.clip_counts)
        groups = len(counts) if self.acc.policy.is_per_layer else 1
        return float(counts[:groups].sum()) / (groups * int(self.state.example_count))


_optax_global = jax.jit(optax.per_example_global_norm_clip)
_optax_layer = jax.jit(lambda grads, c: optax.per_example_layer_norm_clip(grads, c, uniform=True))


def optax_step(fn, batch: list[jax.Array], bound: float) -> Callable[[], None]:
    bound = jnp.float32(bound)
    return lambda: jax.block_until_ready(fn(batch, bound))


def row_methods(flat, batch_size, views, bounds):
    """The five timed callables of one row, and its two accumulator steps (for their stats).

    Also checks that ``jax.device_put`` aliased every layer batch instead of copying it.
    """
    specs = [LayerSpec(f"layer{k}", (x.shape[1],), "float32") for k, x in enumerate(views)]
    batch = to_device(views)
    if not all(is_zero_copy(host, dev) for host, dev in zip(views, batch)):
        print("warning: jax.device_put copied a layer batch (not zero-copy)")
    valid = jax.device_put(np.ones(batch_size, bool))
    c_global, c_layer = bounds
    ours_g = AccumulatorStep(specs, ClipPolicy(BoundKind.GLOBAL, c_global), batch, valid)
    ours_l = AccumulatorStep(specs, ClipPolicy(BoundKind.PER_LAYER_UNIFORM, c_layer), batch, valid)
    floor = flat[: batch_size * sum(x.shape[1] for x in views)]  # the layers' bytes if B % 16 == 0
    methods = {
        "ours_g": ours_g,
        "optax_g": optax_step(_optax_global, batch, c_global),
        "ours_l": ours_l,
        "optax_l": optax_step(_optax_layer, batch, c_layer),
        "floor": floor.max,
    }
    return methods, [ours_g, ours_l]


# ----------------------------------------------------------------------------- timing


def calls_for(fn: Callable[[], None], min_seconds: float) -> int:
    """Warms ``fn`` up (compiling it) and returns how many calls last ``min_seconds``."""
    for _ in range(3):
        fn()
    start, calls = time.perf_counter(), 0
    while (elapsed := time.perf_counter() - start) < min_seconds / 4:
        fn()
        calls += 1
    return max(1, math.ceil(min_seconds * calls / elapsed))


def seconds_per_call(fn: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def time_samples(methods: dict[str, Callable[[], None]], settings: Settings,
                 shuffle: random.Random | None = None) -> dict[str, list[float]]:
    """Seconds per call of each method, ``settings.repeats`` times, measured interleaved.

    With ``shuffle``, the methods run in a new random order in every repeat.
    """
    calls = {name: calls_for(fn, settings.min_measure_s) for name, fn in methods.items()}
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(settings.repeats):
        order = list(methods)
        if shuffle is not None:
            shuffle.shuffle(order)
        for name in order:
            samples[name].append(seconds_per_call(methods[name], calls[name]))
    return samples


def time_methods(methods: dict[str, Callable[[], None]], settings: Settings) -> dict[str, float]:
    """Median seconds per call of each method, measured interleaved."""
    return {name: statistics.median(s) for name, s in time_samples(methods, settings).items()}


def run_rows(settings: Settings) -> list[Row]:
    """Times every row, printing each as soon as it is measured."""
    rows, rng = [], np.random.default_rng(0)
    for batch_size in settings.batches:
        for params in settings.params:
            flat = random_flat(batch_size, params, max(settings.layer_counts), rng)
            for layers in settings.layer_counts:
                views = layer_views(flat, batch_size, layer_sizes(params, layers))
                methods, steps = row_methods(flat, batch_size, views, median_bounds(views))
                seconds = time_methods(methods, settings)
                clip_fractions = (step.clip_fraction() for step in steps)
                row = Row(batch_size, params, layers, *clip_fractions, seconds)
                print_row(row)
                rows.append(row)
                del methods, steps
            del flat
    return rows


# ----------------------------------------------------------------------------- tricks


TRICKS = Tricks._fields


@dataclasses.dataclass
class TrickRow:
    """Seconds per GLOBAL step of one (B, P, K), per repeat: all tricks on ("with"), each one off, none."""

    batch: int
    params: int
    layers: int
    samples: dict[str, list[float]]

    def seconds(self, method: str) -> float:
        return statistics.median(self.samples[method])

    def ratio(self, trick: str) -> float:
        """Median over repeats of without / with (measured in the same repeat): > 1 when the trick buys."""
        return statistics.median(t / w for t, w in zip(self.samples[trick], self.samples["with"]))


def trick_methods(batch_size, views, c_global) -> dict[str, AccumulatorStep]:
    specs = [LayerSpec(f"layer{k}", (x.shape[1],), "float32") for k, x in enumerate(views)]
    batch, valid = to_device(views), jax.device_put(np.ones(batch_size, bool))
    policy = ClipPolicy(BoundKind.GLOBAL, c_global)
    variants = {"with": Tricks(), **{t: Tricks()._replace(**{t: False}) for t in TRICKS},
                "none": Tricks(*(False for _ in TRICKS))}
    return {name: AccumulatorStep(specs, policy, batch, valid, tricks) for name, tricks in variants.items()}


def run_trick_rows(settings: Settings) -> list[TrickRow]:
    """Times every trick on and off for every (B, P, K), printing each row as soon as it is measured."""
    rows, rng, shuffle = [], np.random.default_rng(0), random.Random(0)
    for batch_size in settings.trick_batches:
        for params in settings.params:
            flat = random_flat(batch_size, params, max(settings.layer_counts), rng)
            for layers in settings.layer_counts:
                views = layer_views(flat, batch_size, layer_sizes(params, layers))
                methods = trick_methods(batch_size, views, median_bounds(views)[0])
                row = TrickRow(batch_size, params, layers, time_samples(methods, settings, shuffle))
                print_trick_row(row)
                rows.append(row)
                del methods
            del flat
    return rows


TRICK_HEADER = f"{'trick':<18} {'B':>4} {'P':>9} {'K':>3} | {'with us':>9} {'without us':>10} {'ratio':>6}"


def print_trick_row(row: TrickRow) -> None:
    for trick in (*TRICKS, "none"):
        print(f"{trick:<18} {row.batch:>4} {row.params:>9.0e} {row.layers:>3} | "
              f"{row.seconds('with') * 1e6:>9.1f} {row.seconds(trick) * 1e6:>10.1f} {row.ratio(trick):>6.3f}",
              flush=True)


def print_trick_summary(rows: Sequence[TrickRow]) -> None:
    print(f"\n{'trick':<18} | {'median ratio':>12} {'max ratio':>9}  (without / with, over {len(rows)} rows)")
    for trick in (*TRICKS, "none"):
        ratios = [row.ratio(trick) for row in rows]
        print(f"{trick:<18} | {statistics.median(ratios):>12.3f} {max(ratios):>9.3f}")


# ----------------------------------------------------------------------------- compilation


def bucket_of(size: int) -> int:
    """The next power of two >= size."""
    return 1 << (size - 1).bit_length()


def compilation_check(max_batch: int) -> tuple[int, int]:
    """(new compilations after warm-up, buckets) when fed every batch size 1..max_batch."""
    sizes = layer_sizes(10_000, 8)
    specs = [LayerSpec(f"layer{k}", (n,), "float32") for k, n in enumerate(sizes)]
    acc = ClipAccumulator(specs, ClipPolicy(BoundKind.GLOBAL, l2_norm_clip=100.0))
    rng = np.random.default_rng(1)
    pool = [rng.standard_normal((max_batch, n), dtype=np.float32) for n in sizes]
    buckets = [1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch]
    buffers = {b: [aligned_empty(b * n).reshape(b, n) for n in sizes] for b in buckets}

    def padded(size: int) -> tuple[list[jax.Array], jax.Array]:
        bucket = bucket_of(size)
        for buf, src in zip(buffers[bucket], pool):
            buf[:size] = src[:size]  # as the server does: real rows first, the rest masked off
        return to_device(buffers[bucket]), jax.device_put(np.arange(bucket) < size)

    state = acc.init()
    for bucket in buckets:  # warm-up: one program per bucket
        state = acc.update(state, *padded(bucket))
    jax.block_until_ready(state)
    state = acc.init()
    before = ClipAccumulator.compiled_programs()
    for size in range(1, max_batch + 1):
        state = acc.update(state, *padded(size))
        jax.block_until_ready(state)  # the host buffers are reused for the next batch
    new = ClipAccumulator.compiled_programs() - before
    expected = max_batch * (max_batch + 1) // 2
    if int(state.example_count) != expected:
        raise AssertionError(f"example_count {int(state.example_count)} != {expected}")
    return new, len(buckets)


# ----------------------------------------------------------------------------- output


HEADER = (
    f"{'B':>4} {'P':>9} {'K':>3} {'clip_g':>6} {'clip_l':>6} | {'ours_g':>7} {'optax_g':>7} "
    f"{'g/opt':>6} | {'ours_l':>7} {'optax_l':>7} {'l/opt':>6} | {'floor':>6} {'g/flr':>5} "
    f"{'l/flr':>5}"
)


def print_environment() -> None:
    device = jax.devices()[0]
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    print(f"python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
          f"optax {optax.__version__}, numpy {np.__version__}")
    print(f"device: {device.platform} / {device.device_kind} ({jax.device_count()} device(s)); "
          f"CPUs: os.cpu_count()={os.cpu_count()}, usable={affinity}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")


def print_table_header(settings: Settings) -> None:
    print(f"\nmedian of {settings.repeats} repeats, each >= {settings.min_measure_s * 1e3:.0f} ms; "
          "throughput in GB/s of input (B*P*4 bytes / time); clip_* = fraction clipped")
    print(HEADER)
    print("-" * len(HEADER))


def print_row(row: Row) -> None:
    g = {m: row.gbps(m) for m in row.seconds}
    print(
        f"{row.batch:>4} {row.params:>9.0e} {row.layers:>3} {row.clip_fraction_global:>6.2f} "
        f"{row.clip_fraction_layer:>6.2f} | {g['ours_g']:>7.2f} {g['optax_g']:>7.2f} "
        f"{row.ratio_global:>6.2f} | {g['ours_l']:>7.2f} {g['optax_l']:>7.2f} "
        f"{row.ratio_layer:>6.2f} | {g['floor']:>6.2f} {g['ours_g'] / g['floor']:>5.2f} "
        f"{g['ours_l'] / g['floor']:>5.2f}",
        flush=True,
    )


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (~15 s)")
    parser.add_argument("--repeats", type=int, default=None, help="measurements per method and row")
    parser.add_argument("--only", choices=("optax", "tricks"), default=None,
                        help="run one table only (optax: the table against optax and the compilation check)")
    for name, what in (("batches", "B"), ("params", "P"), ("layer-counts", "K")):
        parser.add_argument(f"--{name}", type=int, nargs="+", default=None, help=f"the {what} values of the grid")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.batches is not None:
        settings = dataclasses.replace(settings, batches=tuple(args.batches), trick_batches=tuple(args.batches))
    for name in ("params", "layer_counts"):
        if getattr(args, name) is not None:
            settings = dataclasses.replace(settings, **{name: tuple(getattr(args, name))})
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error("--repeats must be >= 1")
        settings = dataclasses.replace(settings, repeats=args.repeats)
    return settings, args.only


def main(argv: Sequence[str] | None = None) -> float | None:
    settings, only = parse_args(argv)
    start = time.perf_counter()
    print_environment()
    if only != "tricks":
        print_table_header(settings)
        rows = run_rows(settings)
        new, buckets = compilation_check(settings.compile_max_batch)
        print(f"\ncompilation check: {buckets} buckets (1..{settings.compile_max_batch}) warmed up, "
              f"batch sizes 1..{settings.compile_max_batch} fed: {new} new compilations "
              f"({'OK' if new == 0 else 'FAIL: must be 0'})")
    if only != "optax":
        print(f"\nXLA:CPU tricks, GLOBAL bound: median us per step of {settings.repeats} interleaved repeats, "
              "all tricks on (with) and one off (without); ratio = without / with")
        print(TRICK_HEADER)
        print("-" * len(TRICK_HEADER))
        print_trick_summary(run_trick_rows(settings))
    if only == "tricks":
        print(f"total time {time.perf_counter() - start:.0f} s")
        return None
    ratios = [r.ratio_global for r in rows] + [r.ratio_layer for r in rows]
    median = statistics.median(ratios)
    print(f"\nmedian ours/optax throughput ratio: global "
          f"{statistics.median(r.ratio_global for r in rows):.3f}, per-layer "
          f"{statistics.median(r.ratio_layer for r in rows):.3f}")
    print(f"total time {time.perf_counter() - start:.0f} s")
    print(f"engine_vs_optax_median_ratio={median:.3f}")
    return median


if __name__ == "__main__":
    main()
