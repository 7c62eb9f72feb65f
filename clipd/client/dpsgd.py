"""DP-SGD through clipd: a trainer sends each step's per-example gradients; the server clips, sums, noises
and accounts them, and the trainer applies the noised mean it gets back.

Each step is one aggregation under a privacy policy and so one release on the
trainer's ledger: the examples of a step are a Poisson sample of the data set
(each joins with probability ``q``, drawn by the trainer), the server clips
each example's gradient to ``C`` (``l2_norm_clip``, over all layers together:
Opacus' flat clipping), sums them, adds Gaussian noise of stddev ``z * C`` per
coordinate and divides by the expected batch size ``q * n`` (the public
denominator: the true count would leak), then composes the step's
``PoissonSampled(Gaussian(z))`` into the ledger's epsilon (dp_accounting's RDP
accountant by default). What the trainer gets back is what Opacus' optimizer
puts into ``p.grad``.

Example (a server on localhost:50051; ``per_example_grads`` from
``torch.func.vmap(grad(loss))`` or ``jax.vmap(jax.grad(loss))``)::

    with Client("localhost:50051") as client, \
            DpSgd(client, {"w": (10, 3), "b": (3,)}, l2_norm_clip=1.0, noise_multiplier=1.1,
                  sampling_rate=256 / 60_000, dataset_size=60_000, delta=1e-5) as dp:
        for _ in range(steps):
            chosen = np.flatnonzero(rng.random(n) < dp.sampling_rate)   # Poisson sampling
            step = dp.step(per_example_grads(params, chosen))  # {"w": (B, 10, 3), "b": (B, 3)}
            params = {k: params[k] - lr * step.gradient[k] for k in params}
        dp.epsilon   # of the whole run so far, at delta

The sampling must really be Poisson with rate ``q`` and secret randomness
(``np.random.default_rng()`` seeds from the OS): the epsilon assumes it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
import uuid
from typing import Any

import numpy as np

from clipd import _process
from clipd.v1 import clipd_pb2 as pb

from .errors import NotFoundError
from .privacy import Audit, Privacy
from .updates import flatten

PHASES = ("step", "create", "submit", "finalize", "cancel")


@dataclasses.dataclass(frozen=True)
class Step:
    """One DP-SGD step's release."""

    gradient: dict[str, np.ndarray]  # the noised sum of clipped gradients / (q * n), per layer
    examples: int  # how many per-example gradients were sent (not private: the trainer's own knowledge)
    release: pb.Release  # the noise, the bound, epsilon of this step and of the ledger so far
    aggregation_id: str
    seconds: dict[str, float]  # wall time of the step's one call (step), or of each of its calls (create, submit,
    # finalize, cancel)

    @property
    def epsilon(self) -> float:
        """The ledger's epsilon after this step (the whole run so far), at the ledger's delta."""
        return self.release.ledger_epsilon


class DpSgd:
    """The clip, noise and accounting part of DP-SGD, done by a clipd server (see the module's docstring).

    Args:
      client: a :class:`~clipd.client.Client`.
      layers: the model's parameters, as for ``create_aggregation``: ``{name: shape}`` or
        ``layers_like(params)``; each step's gradients name the same layers.
      l2_norm_clip: ``C``, the bound on one example's gradient over all layers.
      policy: ``global`` (default: the whole gradient clipped to ``C``, Opacus' flat clipping) or
        ``per_layer_uniform`` (each of the K layers clipped to ``C / sqrt(K)`` on its own: Opacus'
        per-layer clipping with equal thresholds; the example's bound is still ``C``).
      noise_multiplier: ``z``: noise of stddev ``z * C`` per coordinate of the sum.
      sampling_rate: ``q``, each example's probability of joining a step (1: every example, every step).
      dataset_size: ``n``; the mean divides by ``q * n``.
      delta: the ledger's delta.
      ledger_id: the run's ledger (a new one by default); another trainer's steps on the same ledger
        add to the same epsilon.
      max_epsilon: the ledger's budget (0: none): the step that would pass it is refused with
        ``FailedPreconditionError`` before anything of it is sent.
      accountant: ``rdp`` (default) or ``pld``.
      metrics_noise_multiplier: with ``z_m > 0`` each release also carries noised per-layer clip counts
        and a noised example count (``release.layer_clipped``, ``release.examples``, and the admin
        API); the sum's noise is raised so that the step as a whole keeps ``z``.
      keep: keep each step's finalized aggregation on the server (for the admin API) instead of
        cancelling it; :meth:`cancel_kept` drops them.
      seed: TEST MODE: reproducible noise (the release is then not private).
      one_call: each step is one call (``Client.step``, default): the server creates the step's aggregation,
        sums the gradients, releases and answers, and drops the step before; a retried call returns the same
        release, recorded once. A step larger than one message (the client's ``max_message_bytes``), or a
        server without it (Ray shard hosts, an older server), goes through the separate calls below. ``False``:
        always those. With one call, this process's glibc keeps freed memory for reuse (``M_MMAP_THRESHOLD``
        32 MiB, ``M_TRIM_THRESHOLD`` 8 MiB, as ``clipd serve`` sets them; ``MALLOC_MMAP_THRESHOLD_`` and
        ``MALLOC_TRIM_THRESHOLD_`` in the environment win): each step's request, megabytes, would otherwise be
        mapped and faulted in afresh.
      pipeline: with the separate calls (create, submit, finalize, cancel): create the next step's aggregation,
        and drop the finished one, on a thread of the helper's own while the trainer computes its next gradients
        (default); ``False``: each step does every call in turn. The next step's creation reserves its release
        on the ledger early: a budget it can't afford is raised by the next :meth:`step`, before anything is sent.
      mechanism: ``independent`` (default: fresh noise each step, Poisson sampling at ``sampling_rate``),
        or ``blt`` / ``banded``: DP-FTRL, the steps' noise one correlated stream planned for ``steps``
        steps in ``epochs`` epochs (each example in one step of each epoch: the declared participation,
        ``steps / epochs`` steps apart, trusted by the server; no sampling amplification). ``sampling_rate``
        is then the batch's fraction of the data set (the mean divides by it times ``dataset_size``).
      steps, epochs: the stream's plan (correlated mechanisms only).
      buffers: a BLT's buffers or a banded strategy's bands (0: chosen).
      audit: a canary :class:`~clipd.client.Audit` of the ledger: canary examples in its steps, drawn as its
        examples are (Poisson at ``sampling_rate``, or one step per epoch of a stream); close it with
        ``client.close_audit(trainer.ledger_id)`` (a stream's closes with its last step).

    Use it as a context manager (or call :meth:`close`): closing drops the last step's aggregation (its release
    stays on the ledger), or the one made ahead.
    """

    def __init__(self, client, layers: Any, *, l2_norm_clip: float, noise_multiplier: float, policy: str = "global",
                 sampling_rate: float, dataset_size: int, delta: float, ledger_id: str | None = None,
                 max_epsilon: float = 0.0, accountant: str = "rdp", metrics_noise_multiplier: float = 0.0,
                 keep: bool = False, seed: int | None = None, pipeline: bool = True, mechanism: str = "independent",
                 steps: int = 0, epochs: int = 1, buffers: int = 0, audit: Audit | None = None,
                 one_call: bool = True) -> None:
        if not 0.0 < sampling_rate <= 1.0:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be at least 1, got {dataset_size}")
        if one_call:  # a request of megabytes every few milliseconds: its freed pages kept for the next
            _process.tune(_process.MALLOC_SETTINGS)
        self.client = client
        self.layers = layers
        self.l2_norm_clip = float(l2_norm_clip)
        self.policy = policy
        self.sampling_rate = float(sampling_rate)
        self.dataset_size = int(dataset_size)
        self.keep = keep
        self.kept: list[str] = []
        self.pipeline = pipeline
        self.one_call = one_call
        self._last: str | None = None  # the last one-call step's aggregation (dropped by the next step's call)
        self._next: concurrent.futures.Future | None = None  # the next step's aggregation, being created
        self._cancels: list[concurrent.futures.Future] = []
        self.steps = 0
        self.epsilon = 0.0
        correlated: dict[str, Any] = {}
        if mechanism != "independent":
            if steps < 1 or epochs < 1 or steps % epochs:
                raise ValueError(f"a correlated mechanism plans its steps: steps ({steps}) a multiple of epochs"
                                 f" ({epochs}), both >= 1")
            correlated = dict(mechanism=mechanism, releases=steps, min_separation=steps // epochs,
                              max_participations=epochs, buffers=buffers, declared_participation=True)
        poisson = sampling_rate < 1.0 and not correlated
        self.privacy = Privacy(
            ledger_id=ledger_id or f"dpsgd-{uuid.uuid4().hex[:12]}", delta=delta,
            noise_multiplier=noise_multiplier, sampling="poisson" if poisson else "none",
            sampling_rate=sampling_rate if poisson else 0.0, max_epsilon=max_epsilon, accountant=accountant,
            public_denominator=self.expected_batch_size, release_mean=True,
            metrics_noise_multiplier=metrics_noise_multiplier, seed=seed, audit=audit, **correlated,
        ).to_proto()

    @property
    def expected_batch_size(self) -> float:
        """``q * n``: what the noised sum is divided by (Opacus' ``expected_batch_size``)."""
        return self.sampling_rate * self.dataset_size

    @property
    def ledger_id(self) -> str:
        return self.privacy.ledger_id

    def step(self, per_example_gradients: Any) -> Step:
        """Clips, sums, noises and accounts one step's per-example gradients; returns the noised mean.

        ``per_example_gradients``: ``{layer: array of (B, *shape)}`` (numpy, torch on the CPU, JAX), the
        gradients of the step's B sampled examples; ``B = 0`` (an empty Poisson sample) is a step too:
        the release is noise alone.
        """
        seconds = dict.fromkeys(PHASES, 0.0)
        if self.one_call:
            step = self._one_call(per_example_gradients, seconds)
            if step is not None:
                return step
            # Too large for one message, or a server without Step (then every step): the separate calls.
            self.one_call = self.client.steps_in_one_call
        started = time.perf_counter()
        if self._next is not None:
            upcoming, self._next = self._next, None
            aggregation = upcoming.result()  # raises what creating it raised (a spent budget)
        else:
            aggregation = self._create()
        seconds["create"] = _lap(started)
        try:
            examples = _batch_size(per_example_gradients)
            if examples:
                started = time.perf_counter()
                self.client.submit(aggregation, per_example_gradients, client_id="trainer")
                seconds["submit"] = _lap(started)
            started = time.perf_counter()
            result = self.client.finalize(aggregation)
            seconds["finalize"] = _lap(started)
        except BaseException:
            # A step that failed (bad gradients, a server gone for longer than the client retries): its
            # aggregation goes, and with it its reservation on the ledger. Cancelling one that was released
            # after all drops only the kept sums: the ledger keeps what was spent.
            _in_background(self.client.cancel, aggregation)
            raise
        if self.keep:
            self.kept.append(aggregation)
        elif self.pipeline:
            self._cancels = [f for f in self._cancels if not f.done()]
            self._cancels.append(_in_background(self.client.cancel, aggregation))
        else:
            started = time.perf_counter()
            self.client.cancel(aggregation)  # drops the kept sums; the ledger keeps the release
            seconds["cancel"] = _lap(started)
        if self.pipeline and not self.one_call:  # (a one-call trainer makes no aggregation ahead)
            self._next = _in_background(self._create)
        self.steps += 1
        self.epsilon = result.release.ledger_epsilon
        return Step(result.sums, examples, result.release, aggregation, seconds)

    def _one_call(self, per_example_gradients: Any, seconds: dict[str, float]) -> Step | None:
        """The step as one call (``Client.step``); None, with nothing done, where it can't be one."""
        started = time.perf_counter()
        examples = _batch_size(per_example_gradients)
        aggregation = uuid.uuid4().hex  # this step's (a retry inside the call names the same)
        result = self.client.step(aggregation, self.layers, per_example_gradients if examples else None,
                                  privacy=self.privacy, policy=self.policy, l2_norm_clip=self.l2_norm_clip,
                                  previous_id="" if self.keep else self._last or "")
        if result is None:
            return None
        seconds["step"] = _lap(started)
        if self.keep:
            self.kept.append(aggregation)
        else:
            self._last = aggregation
        self.steps += 1
        self.epsilon = result.release.ledger_epsilon
        return Step(result.sums, examples, result.release, aggregation, seconds)

    def _create(self) -> str:
        aggregation = self.client.create_aggregation(self.layers, policy=self.policy,
                                                     l2_norm_clip=self.l2_norm_clip, privacy=self.privacy)
        self.client.placement(aggregation)  # asked now (the client keeps it), not when the step submits
        return aggregation

    def close(self) -> None:
        """Drops the last one-call step's aggregation (its release stays on the ledger), and cancels the aggregation
        made ahead for a next step (its reservation on the ledger goes with it)."""
        last, self._last = self._last, None
        if last is not None:
            with contextlib.suppress(NotFoundError):
                self.client.cancel(last)
        upcoming, self._next = self._next, None
        concurrent.futures.wait(self._cancels)
        self._cancels = []
        if upcoming is not None and upcoming.exception() is None:
            self.client.cancel(upcoming.result())

    def __enter__(self) -> DpSgd:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cancel_kept(self) -> None:
        """Drops the finalized aggregations kept with ``keep=True`` (their releases stay on the ledger)."""
        while self.kept:
            self.client.cancel(self.kept.pop())


def _in_background(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` on a daemon thread (one that never keeps the trainer's process alive at exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # handed to whoever waits for it
            future.set_exception(e)

    threading.Thread(target=run, name="clipd-dpsgd", daemon=True).start()
    return future


def _lap(started: float) -> float:
    return time.perf_counter() - started


def _batch_size(gradients: Any) -> int:
    """B, the leading axis of the first array of a ``{layer: (B, *shape)}`` pytree."""
    shape = np.shape(flatten(gradients)[0][1])  # np.shape reads a tensor's .shape: no copy
    return int(shape[0]) if shape else 1


def poisson_sample(dataset_size: int, sampling_rate: float, rng: np.random.Generator | None = None) -> np.ndarray:
    """The indices of a Poisson sample: each of ``dataset_size`` examples joins with probability ``q``.

    ``rng`` defaults to a generator seeded from the OS (what the privacy guarantee assumes);
    pass a seeded one only for reproducible experiments.

    >>> poisson_sample(10, 1.0).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    rng = rng if rng is not None else np.random.default_rng()
    if sampling_rate >= 1.0:
        return np.arange(dataset_size)
    return np.flatnonzero(rng.random(dataset_size) < sampling_rate)


__all__ = ["PHASES", "DpSgd", "Step", "poisson_sample"]
