"""clipd as the aggregator of NVIDIA FLARE's FedAvg: each site's update clipped, summed and released with central DP.

NVFlare 2.9 leaves formal privacy to the sites (Opacus inside each one) and offers filters (``PercentilePrivacy``,
``SVTPrivacy``, ``ExcludeVars``) that come with no accountant. :class:`ClipdAggregator` is a ``ModelAggregator``
for NVFlare's ``FedAvg`` that sends each site's update to a clipd server instead, which clips it (one L2 bound over
the whole update), sums, noises, accounts the release on a ledger, and stops at a budget::

    from clipd.client import Privacy
    from clipd.client.nvflare import ClipdFedAvgRecipe

    recipe = ClipdFedAvgRecipe(
        name="digits", min_clients=3, num_rounds=20, model=Net(), train_script="client.py",
        clipd_target="clipd.example.org:50051", clipping_norm=1.0,
        privacy=Privacy(ledger_id="digits-run-1", delta=1e-5, noise_multiplier=1.0, max_epsilon=8.0),
    )
    recipe.execute(SimEnv(num_clients=3))

Each round (:class:`~clipd.client.rounds.PrivateRounds` holds the logic it shares with the Flower strategy):

* ``reset_stats`` (the round's start, before the sites are asked to train) opens a clipd aggregation with
  ``unit="client"`` for the global model's floating arrays: each site is one unit of privacy, its update one
  contribution, sent by the aggregator as a trusted submitter (its token: the admin token, which also opens and
  releases the rounds, read from the ``CLIPD_TOKEN`` environment variable of the NVFlare server) under the site's
  name. A ledger that
  can't afford the release refuses it there: training stops (:class:`ClipdFedAvg` asks no site to train and ends
  the job; NVFlare's own ``FedAvg`` goes on with rounds that leave the model as it is).
* With ``Privacy(..., sampling="poisson", sampling_rate=q, drawn_by="server")`` clipd draws each round's sites:
  :class:`ClipdFedAvg` sends training only to the sites drawn among those FedAvg sampled (let it sample all of
  them); under NVFlare's own ``FedAvg`` every sampled site trains, and the update of one not drawn is not sent
  (logged). ``num_sampled_clients``: the expected count, q times the sites.
* ``accept_model`` streams each site's update as it arrives: its ``DIFF`` as it is, or ``params - global`` for
  ``FULL`` (the global model: a persistor's, from the server's context, or the one FedAvg's training task carries;
  where neither is known, a round with a FULL update releases none of its updates). Nothing of a site is kept in
  the NVFlare server once it is sent. A site whose update has another
  shape or misses an array contributes nothing (logged); NaN or inf is zeroed by the server and counted.
* ``aggregate_model`` finalizes and returns the noised mean ``noised_sum / m`` as a ``DIFF`` (FedAvg adds it to
  the global model), ``m`` the public number of sampled sites (never the replies that arrived, never NVFlare's
  weighted mean). The round's privatised metrics (epsilon, ledger epsilon, noise stddev, budget left) go into
  the returned model's ``metrics`` and ``meta["clipd"]`` and NVFlare's log.

With ``sites_submit=True`` (:class:`ClipdFedAvgRecipe`, or :class:`ClipdAggregator` beside a
:class:`ClipdSiteSubmitter` on each site) the sites submit their updates to clipd themselves: each training task
carries the round's aggregation id, each site's :class:`ClipdSiteSubmitter` (a filter on its results) streams the
site's update straight to clipd under its own credential and sends NVFlare's server a receipt in its place. The
update crosses the network once instead of twice, and the NVFlare server never holds a site's update. Each site
then needs to reach clipd, with a token that lets it submit: a client token of its own for the ledger (``clipd
token --client site-1 --ledger L``: clipd refuses it under any other name), or a submitter token; none
where clipd runs without authentication. A site without the filter, or a round whose aggregation isn't open when
its tasks go out, sends its update through NVFlare as before.

Needs NVFlare (``pip install '.[nvflare]'``: nvflare 2.9.0); the clipd client itself needs only numpy, grpcio and
protobuf.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading
from typing import Any

import numpy as np

try:
    from nvflare.apis.dxo import DXO, DataKind, from_shareable
    from nvflare.apis.filter import Filter
    from nvflare.apis.fl_constant import FilterKey, FLContextKey, ReturnCode
    from nvflare.apis.shareable import Shareable
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.aggregators.model_aggregator import ModelAggregator
    from nvflare.app_common.app_constant import AppConstants
    from nvflare.app_common.app_event_type import AppEventType
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils
    from nvflare.app_common.workflows.fedavg import FedAvg
except ImportError as e:  # pragma: no cover - exercised where nvflare is missing
    raise ImportError("clipd.client.nvflare needs NVIDIA FLARE: pip install '.[nvflare]' (nvflare 2.9.0)") from e

from ._client import Client
from .errors import ClipdError
from .privacy import Adaptive, Audit, Privacy
from .rounds import PrivateRounds, update_of

__all__ = ["ClipdAggregator", "ClipdFedAvg", "ClipdFedAvgRecipe", "ClipdSiteSubmitter", "privacy_config"]  # noqa: F822 (made on demand)


ROUND_HEADER = "clipd_round"  # a training task's header: the round's aggregation, for the sites that submit
RECEIPT = "clipd_receipt"  # the one array of a site's result in place of its update, which it submitted itself
_TASK = "clipd.task"  # a site's task context: what the task data said, for its result


def privacy_config(privacy: Privacy | dict | None) -> dict | None:
    """A privacy policy as plain data: NVFlare writes an aggregator's arguments into the job's configuration and
    builds it again on the server from them, so they must be builtins."""
    if privacy is None or isinstance(privacy, dict):
        return privacy
    return dataclasses.asdict(privacy)


def _privacy(config: dict | None) -> Privacy | None:
    if config is None:
        return None
    adaptive, audit = config.get("adaptive"), config.get("audit")
    return Privacy(**{**config, "adaptive": Adaptive(**adaptive) if isinstance(adaptive, dict) else adaptive,
                      "audit": Audit(**audit) if isinstance(audit, dict) else audit})


def _numpy(value) -> np.ndarray:
    """An array of a site's update as numpy: NVFlare hands numpy arrays, torch tensors (the PyTorch exchange format)
    or lazy references to tensors offloaded to disk (``enable_tensor_disk_offload``)."""
    if callable(getattr(value, "materialize", None)):
        value = value.materialize()
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _connect(component: Any) -> Client:
    """A connection to clipd from an NVFlare component's arguments: ``target``, ``token`` (else the environment
    variable ``token_env``), ``tls_ca``, ``timeout``, ``retry_timeout``."""
    token = component.token if component.token is not None else os.environ.get(component.token_env)
    return Client(component.target, token=token, timeout=component.timeout, retry_timeout=component.retry_timeout,
                  root_certificates=pathlib.Path(component.tls_ca).read_bytes() if component.tls_ca else None)


class _Log:
    """The aggregator's NVFlare log, for :class:`PrivateRounds`."""

    def __init__(self, aggregator: ModelAggregator) -> None:
        self.info, self.warning, self.error = aggregator.info, aggregator.warning, aggregator.error


class ClipdAggregator(ModelAggregator):
    """A ``ModelAggregator`` for NVFlare's ``FedAvg`` whose rounds are clipd aggregations (see the module).

    Args (builtins only: NVFlare writes them into the job's configuration and builds the aggregator again on
    its server from them):
      target: the clipd server, ``host:port``.
      num_sampled_clients: m, the public denominator: the sites sampled per round (FedAvg's ``num_clients``).
      clipping_norm: the bound C on each site's update (one L2 norm over its floating arrays); None with adaptive
        clipping (the bound starts at ``privacy.adaptive.initial_bound``).
      privacy: the privacy policy of every round's release (:class:`clipd.client.Privacy`, or its
        :func:`privacy_config`); None: clipped, not noised (not differentially private).
      token_env: the environment variable of the NVFlare server that holds the clipd admin token it opens,
        submits to and releases the rounds with; ``token`` instead puts it in the job's configuration.
      tls_ca: a CA certificate file (PEM) to reach a clipd server over TLS.
      non_finite: clipd's policy for an update holding NaN or inf (``zero_example``: zeroed and counted).
      keep_results: leave each finalized aggregation on the clipd server.
      timeout: seconds for each clipd call.
      retry_timeout: how long a clipd server that is unreachable (restarting) is retried before the round gives up.
      sites_submit: each training task carries the round's aggregation id, so that sites with a
        :class:`ClipdSiteSubmitter` submit their updates to clipd themselves and send receipts here.
    """

    def __init__(self, target: str, num_sampled_clients: int, clipping_norm: float | None = None,
                 privacy: dict | None = None, token_env: str = "CLIPD_TOKEN", token: str | None = None,
                 tls_ca: str | None = None, non_finite: str = "zero_example", keep_results: bool = False,
                 timeout: float = 600.0, retry_timeout: float = 60.0, sites_submit: bool = False) -> None:
        super().__init__()
        self.target = target
        self.num_sampled_clients = num_sampled_clients
        self.clipping_norm = clipping_norm
        self.privacy = privacy_config(privacy)
        self.token_env = token_env
        self.token = token
        self.tls_ca = tls_ca
        self.non_finite = non_finite
        self.keep_results = keep_results
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self.sites_submit = sites_submit
        _privacy(self.privacy)  # (a policy that can't be built fails here, in the job's code, not on the server)
        self._rounds: PrivateRounds | None = None
        self._round = 0
        self._lost: str | None = None  # why the round's release can't be made from all its updates
        self._global_known = False  # the open round's arrays are the global model's (not zeros: see accept_model)
        self._lock = threading.Lock()  # (tasks go out on the sites' threads, results come in on another)

    def handle_event(self, event_type: str, fl_ctx) -> None:
        """ModelAggregator's, and: the model FedAvg sends each site to train (``BEFORE_TRAIN_TASK``, as it goes out)
        is this round's global model where the server's context holds none (FedAvg with its initial model given
        inline and no persistor). The round's aggregation opens then, if it could not at the round's start. With
        ``sites_submit`` the task carries the open round's aggregation id (``ROUND_HEADER``)."""
        super().handle_event(event_type, fl_ctx)
        if event_type != AppEventType.BEFORE_TRAIN_TASK:
            return
        task = fl_ctx.get_prop(AppConstants.TRAIN_SHAREABLE)
        if task is None:
            return
        with self._lock:  # (the task itself is not kept: NVFlare lets go of its copy of the model once it is sent)
            rounds = self.rounds
            opened = rounds.open_round
            if rounds.stopped is None and self._lost is None and (opened is None or not self._global_known):
                current = self._global_model(task)
                if current is not None and opened is None:
                    self._open(current)
                elif current is not None:
                    self._learn_global(current)
            if self.sites_submit:
                open_round = rounds.open_round if self._lost is None else None
                task.set_header(ROUND_HEADER, None if open_round is None else
                                {"aggregation_id": open_round.aggregation_id, "round": open_round.number})

    # NVFlare's calls ------------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """A round starts: its clipd aggregation opens now (before any site trains) when the global model is known
        here, else with the first update."""
        rounds = self.rounds
        with self._lock:
            rounds.cancel_open()
            self._round = self._current_round()
            self._lost = None
            current = self._global_model()
            if rounds.stopped is not None:
                self.warning(f"clipd: round {self._round} is not aggregated: {rounds.stopped}")
            elif current is not None:
                self._open(current)

    def accept_model(self, model: FLModel) -> None:
        """Streams one site's update into the round's aggregation (nothing of it is kept here)."""
        site = str((model.meta or {}).get("client_name") or "unknown site")
        rounds = self.rounds
        if rounds.stopped is not None:
            self.info(f"clipd: the update of {site} is not sent: {rounds.stopped}")
            return
        if RECEIPT in (model.params or {}):
            self._receipt(site, (model.meta or {}).get("clipd"))
            return
        params = {name: _numpy(value) for name, value in (model.params or {}).items()}
        diff = model.params_type == ParamsType.DIFF
        with self._lock:
            if self._lost is not None:
                self.error(f"clipd: the update of {site} is not sent: {self._lost}")
                return
            if rounds.open_round is None or (not diff and not self._global_known):
                current = self._global_model()
                if current is None and not diff:
                    # Released from the other sites' updates alone, the round would move the model by a share of
                    # what it should: it is released from all of them or none.
                    self._lost = (f"the update of {site} is a FULL model and the global model is not known here, so"
                                  f" round {self._round} releases nothing (send DIFF:"
                                  " params_transfer_type=TransferType.DIFF)")
                    self.error(f"clipd: {self._lost}")
                    rounds.cancel_open()
                    return
                if rounds.open_round is not None and current is not None:
                    self._learn_global(current)
                elif not self._open(current if current is not None else {k: np.zeros_like(v) for k, v in
                                                                           params.items()}, known=current is not None):
                    return
        update = rounds.update_from(site, params, diff=diff)
        del params
        if update is not None:
            rounds.submit(site, update)

    def aggregate_model(self) -> FLModel:
        """Finalizes the round: the noised mean ``noised_sum / m`` as a DIFF, with the privatised metrics; an
        empty DIFF (the model unchanged) when nothing is released."""
        rounds = self.rounds
        if self._lost is not None:
            self.error(f"clipd: round {self._round} not released: {self._lost}; the global model is unchanged")
            return FLModel(params_type=ParamsType.DIFF, params={}, metrics={"clipd_released": 0.0},
                           meta={"clipd": {"released": False, "stopped": rounds.stopped, "lost": self._lost}})
        sent = rounds.open_round.submitted if rounds.open_round is not None else 0
        arrays, metrics = rounds.release(as_update=True)
        if arrays is None:
            if rounds.stopped is None:
                self.warning(f"clipd: round {self._round} not released: the global model is unchanged")
            return FLModel(params_type=ParamsType.DIFF, params={}, metrics={"clipd_released": 0.0},
                           meta={"clipd": {"released": False, "stopped": rounds.stopped}})
        metrics = {**metrics, "clipd_released": 1.0}
        self.info(f"clipd: round {self._round} released from {sent} of m = {self.num_sampled_clients} sites: "
                  + ", ".join(f"{k} {v:.6g}" for k, v in metrics.items() if isinstance(v, float)))
        return FLModel(params_type=ParamsType.DIFF, params=arrays, metrics=metrics,
                       meta={"clipd": {**metrics, "released": True}})

    # Its own -------------------------------------------------------------------------------------------
    def _learn_global(self, current: dict[str, np.ndarray]) -> None:
        """The global model is known now for the round already open (opened by a DIFF, the model unknown then)."""
        opened = self.rounds.open_round
        assert opened is not None
        opened.current = {**opened.current, **current}
        self._global_known = True

    def _receipt(self, site: str, receipt: Any) -> None:
        """A site submitted its update to clipd itself (:class:`ClipdSiteSubmitter`): counted when clipd took it
        into this round's aggregation, logged when it didn't (the site's update is then not in the release)."""
        with self._lock:
            open_round = self.rounds.open_round
            if not isinstance(receipt, dict):
                self.error(f"clipd: {site} sent a receipt without its clipd part: its update is not in the round")
            elif open_round is None or receipt.get("aggregation_id") != open_round.aggregation_id:
                self.error(f"clipd: the receipt of {site} is for aggregation {receipt.get('aggregation_id')!r}, not"
                           f" round {self._round}'s: its update is not in this round")
            elif not receipt.get("submitted"):
                self.warning(f"clipd: round {self._round}: the update of {site} was not taken by clipd"
                             f" ({receipt.get('error')}): it contributes nothing")
            else:
                open_round.submitted += 1
                self.info(f"clipd: round {self._round}: {site} submitted its update to clipd itself")

    @property
    def rounds(self) -> PrivateRounds:
        """The rounds' state, made on the NVFlare server when first needed (with its connection to clipd)."""
        if self._rounds is None:
            self._rounds = PrivateRounds(_connect(self), clipping_norm=self.clipping_norm,
                                         num_sampled_clients=self.num_sampled_clients,
                                         privacy=_privacy(self.privacy), non_finite=self.non_finite,
                                         keep_results=self.keep_results, log=_Log(self), name="nvflare")
        return self._rounds

    def drawn(self, sites: list[str]) -> list[str]:
        """The sites that take part in this round: those clipd draws for its release where its ledger's sampling is
        the server's (``Privacy(..., drawn_by="server")``), else all of them (:meth:`PrivateRounds.drawn`)."""
        try:
            return self.rounds.drawn(sites)
        except ClipdError as e:  # nothing can be sent that the server would take: no site trains this round
            self.error(f"clipd: round {self._round}: the server's draws can't be read: {e}")
            return []

    @property
    def stopped(self) -> str | None:
        """Why training stopped (the ledger refused a round's release), or None."""
        return self._rounds.stopped if self._rounds is not None else None

    def _open(self, current: dict[str, np.ndarray], known: bool = True) -> bool:
        """Opens the round's aggregation; ``known``: ``current`` is the global model (else zeros of its shapes: a DIFF
        needs none of it)."""
        self._global_known = known
        try:
            return self.rounds.open(self._round, current)
        except ClipdError as e:  # the server is down or refuses the round for another reason
            self.error(f"clipd: round {self._round} can't be opened on {self.target}: {e}")
            return False

    def _current_round(self) -> int:
        round_ = self.fl_ctx.get_prop(AppConstants.CURRENT_ROUND) if self.fl_ctx is not None else None
        return int(round_) if round_ is not None else self._round + 1

    def _global_model(self, task: Any = None) -> dict[str, np.ndarray] | None:
        """The global model's arrays as the server holds them this round (FedAvg with a persistor keeps them in a
        new context's sticky ``GLOBAL_MODEL``), else as this round's training ``task`` carries them
        (``handle_event``), or None where neither is known."""
        if self.fl_ctx is not None:
            engine = self.fl_ctx.get_engine()
            context = engine.new_context() if engine is not None else self.fl_ctx
            learnable = context.get_prop(AppConstants.GLOBAL_MODEL)
            weights = learnable.get("weights") if isinstance(learnable, dict) else None
            if weights:
                return {name: _numpy(value) for name, value in weights.items()}
        if task is not None:  # the model this round's training tasks carry (FedAvg without a persistor)
            sent = FLModelUtils.from_shareable(task)
            if sent.current_round in (None, self._round) and sent.params and sent.params_type != ParamsType.DIFF:
                return {name: _numpy(value) for name, value in sent.params.items()}
        return None


class ClipdFedAvg(FedAvg):
    """NVFlare's ``FedAvg`` that ends the job cleanly once clipd's ledger refuses a round: no site is asked to train
    again, the last model saved is the last released one, and the reason is in the log. Otherwise FedAvg itself
    (its arguments, its ``stop_cond``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.watch_stop()

    def watch_stop(self) -> None:
        """FedAvg asks :meth:`should_stop` only under a stop condition: one that never holds stands in for none.
        A site whose training fails is ignored (unless ``ignore_result_error`` says otherwise)."""
        own: Any = getattr(self, "stop_condition")  # noqa: B009 (FedAvg's, untyped)
        self._own_stop_condition = own
        if own is None:
            self.stop_condition = ("clipd_released", 0.0, lambda value, target: False)
        if getattr(self, "_ignore_result_error", None) is None:  # a site that fails contributes nothing, and the
            self._ignore_result_error = True  # mean is still divided by m: the round goes on (FedAvg would stop)

    def _clipd_stopped(self) -> str | None:
        return getattr(self.aggregator, "stopped", None)

    def send_model(self, *args, **kwargs) -> None:
        if (reason := self._clipd_stopped()) is not None:
            self.info(f"clipd: no site trains in round {self.current_round}: {reason}")
            return
        drawn = getattr(self.aggregator, "drawn", None)
        if drawn is not None and kwargs.get("targets") is not None:  # the server draws the round's sites
            offered = list(kwargs["targets"])
            kwargs["targets"] = drawn(offered)
            self.info(f"clipd drew {len(kwargs['targets'])} of the {len(offered)} sites offered for round"
                      f" {self.current_round}: {kwargs['targets']}")
            if not kwargs["targets"]:
                return  # (NVFlare reads no targets as every site)
        super().send_model(*args, **kwargs)

    def is_curr_model_better(self, curr_model: FLModel) -> bool:
        if self._own_stop_condition is None:
            return self._clipd_stopped() is None  # every released round is saved, as FedAvg does without stop_cond
        return super().is_curr_model_better(curr_model)

    def should_stop(self, metrics: dict | None = None) -> bool:
        if (reason := self._clipd_stopped()) is not None:
            self.info(f"clipd: training stops at round {self.current_round}: {reason}")
            return True
        return self._own_stop_condition is not None and super().should_stop(metrics)


class ClipdSiteSubmitter(Filter):
    """A site's filter that submits the site's update to clipd itself, so that NVFlare's server carries a receipt
    instead of the update (see the module; the server's :class:`ClipdAggregator` needs ``sites_submit=True``).

    Add it to each site both ways: on the task data it reads the round's aggregation id from the training task
    (and keeps the global model, for a FULL update); on the result it streams the update (a DIFF as it is, a FULL
    model less the global one) into that aggregation as the site's one contribution, under the site's name, and
    replaces the result's arrays by one array, ``RECEIPT``, with what happened in its meta's ``"clipd"``. A task
    that names no aggregation (the round not open when it went out, or a server without ``sites_submit``) and a
    result that isn't a model pass through as they are.

    Args (builtins only, as NVFlare writes them into the site's configuration):
      target: the clipd server, ``host:port``.
      token_env: the environment variable of the site that holds its clipd token: its client token for the ledger
        (``clipd token --client <site> --ledger <ledger>``) or a submitter token; unset where clipd runs without
        authentication. ``token`` instead puts it in the job's configuration.
      tls_ca: a CA certificate file (PEM) to reach a clipd server over TLS.
      timeout: seconds for each clipd call.
      retry_timeout: how long a clipd server that is unreachable (restarting) is retried before the update is
        reported as not submitted.
    """

    def __init__(self, target: str, token_env: str = "CLIPD_TOKEN", token: str | None = None,
                 tls_ca: str | None = None, timeout: float = 600.0, retry_timeout: float = 60.0) -> None:
        super().__init__()
        self.target = target
        self.token_env = token_env
        self.token = token
        self.tls_ca = tls_ca
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self._client: Client | None = None

    def process(self, shareable: Shareable, fl_ctx) -> Shareable:
        if fl_ctx.get_prop(FLContextKey.FILTER_DIRECTION) == FilterKey.IN:
            task = shareable.get_header(ROUND_HEADER)
            if isinstance(task, dict):  # (a FULL result is a difference from the model the task carries)
                task = {**task, "global": _task_arrays(shareable)}
            fl_ctx.set_prop(_TASK, task if isinstance(task, dict) else None, private=True, sticky=False)
            return shareable
        task = fl_ctx.get_prop(_TASK)
        fl_ctx.set_prop(_TASK, None, private=True, sticky=False)
        if not isinstance(task, dict) or shareable.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            return shareable
        try:
            result = from_shareable(shareable)
        except ValueError:  # (not a DXO: nothing of a model to submit)
            return shareable
        if result.data_kind not in (DataKind.WEIGHT_DIFF, DataKind.WEIGHTS) or not result.data:
            return shareable
        site = fl_ctx.get_identity_name() or "unknown site"
        receipt = {"aggregation_id": task["aggregation_id"], "round": task.get("round"), "site": site,
                   **self._submit(task, site, result)}
        if receipt["submitted"]:
            self.log_info(fl_ctx, f"clipd: submitted the update of {site} to {task['aggregation_id']}")
        else:
            self.log_error(fl_ctx, f"clipd: the update of {site} was not taken by clipd: {receipt['error']}")
        sent = DXO(DataKind.WEIGHT_DIFF, data={RECEIPT: np.zeros(1, np.float32)},
                   meta={**result.meta, "clipd": receipt})
        return sent.update_shareable(shareable)

    def _submit(self, task: dict, site: str, result: DXO) -> dict:
        """Streams the site's update into the round's aggregation: ``submitted`` and, where it wasn't, ``error``. The
        update is made from the result as the NVFlare server's aggregator makes it (:func:`update_of`), against the
        model the task carried."""
        params = {name: _numpy(value) for name, value in result.data.items()}
        diff = result.data_kind == DataKind.WEIGHT_DIFF
        current = task.get("global")
        if current is None and not diff:
            return {"submitted": False, "error": "a FULL model, and the training task carried no model to take it from"}
        if current is None:  # (a DIFF as it is: clipd checks it against the round's layers)
            update = {name: value for name, value in params.items() if np.issubdtype(value.dtype, np.floating)}
        else:
            made, why = update_of(params, {name: _numpy(value) for name, value in current.items()}, diff=diff)
            if made is None:
                return {"submitted": False, "error": f"the reply of {site}{why}"}
            update = made
        try:
            self.client.submit(task["aggregation_id"], update, client_id=site)
        except ClipdError as e:
            return {"submitted": False, "error": str(e)}
        return {"submitted": True}

    @property
    def client(self) -> Client:
        """The site's connection to clipd, made when first needed."""
        if self._client is None:
            self._client = _connect(self)
        return self._client


def _task_arrays(shareable: Shareable) -> dict | None:
    """The model a training task carries (a reference to its arrays, no copy), or None."""
    try:
        data = from_shareable(shareable)
    except ValueError:
        return None
    return data.data if data.data_kind == DataKind.WEIGHTS and isinstance(data.data, dict) else None


def _recipe_class():
    """:class:`ClipdFedAvgRecipe`, made when first asked for: NVFlare's PyTorch recipe needs torch."""
    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
    from nvflare.client.config import TransferType

    class ClipdFedAvgRecipe(FedAvgRecipe):
        """NVFlare's PyTorch ``FedAvgRecipe`` with clipd as its aggregator and :class:`ClipdFedAvg` as its controller.

        Takes the recipe's arguments (``name``, ``min_clients``, ``num_rounds``, ``model``, ``train_script``, ...)
        and clipd's: ``clipd_target``, ``clipping_norm``, ``privacy``, ``num_sampled_clients`` (default
        ``min_clients``: FedAvg samples that many sites a round) and :class:`ClipdAggregator`'s others as
        ``clipd_options``. Sites send their update as a DIFF unless ``params_transfer_type`` says otherwise.
        ``sites_submit=True``: each site submits its update to clipd itself (a :class:`ClipdSiteSubmitter` on
        every site, its arguments other than the target in ``site_options``) and NVFlare carries receipts.
        """

        def __init__(self, *, clipd_target: str, clipping_norm: float | None = None,
                     privacy: Privacy | dict | None = None, num_sampled_clients: int | None = None,
                     clipd_options: dict | None = None, sites_submit: bool = False,
                     site_options: dict | None = None, **recipe: Any) -> None:
            aggregator = ClipdAggregator(clipd_target, num_sampled_clients or recipe["min_clients"], clipping_norm,
                                         privacy_config(privacy), sites_submit=sites_submit,
                                         **(clipd_options or {}))
            recipe.setdefault("params_transfer_type", TransferType.DIFF)
            recipe.setdefault("aggregator_data_kind", DataKind.WEIGHT_DIFF)
            super().__init__(aggregator=aggregator, **recipe)
            if sites_submit:  # (one filter each way: NVFlare builds each from its arguments on the site)
                self.add_client_input_filter(ClipdSiteSubmitter(clipd_target, **(site_options or {})), tasks=["train"])
                self.add_client_output_filter(ClipdSiteSubmitter(clipd_target, **(site_options or {})), tasks=["train"])

        def _create_controller(self, persistor_id: str, model_params, model_aggregator) -> FedAvg:
            controller = super()._create_controller(persistor_id, model_params, model_aggregator)
            clipd = ClipdFedAvg.__new__(ClipdFedAvg)  # the recipe's FedAvg, its arguments as they are, with the stop
            clipd.__dict__.update(controller.__dict__)
            clipd.watch_stop()
            return clipd

    return ClipdFedAvgRecipe


def __getattr__(name: str):
    if name == "ClipdFedAvgRecipe":
        recipe = globals()["ClipdFedAvgRecipe"] = _recipe_class()
        return recipe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
