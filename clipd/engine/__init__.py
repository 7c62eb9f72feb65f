"""clipd.engine: the clipping math, in JAX and numpy, with no gRPC and no web.

Its I/O is its own state's: a partial state reads and writes its checkpoint format from a file the
caller opened (``PartialState.write_to``, ``read_from``), and a secure release draws its discrete
Gaussian noise in worker interpreters that write their share to a temporary file.
"""

from ._accumulator import (
    FIXED_POINT_DELTA_ROWS,
    NUM_BUCKETS,
    RATIO_BUCKETS,
    AccumulatorState,
    ClipAccumulator,
    ExampleScales,
    add_example,
    merge,
    multiplier,
)
from ._declearn import L2Clipping, L2GlobalClipping
from ._jax_privacy import clip_pytree
from ._opacus import ConstantFlatClipper, ConstantPerLayerClipper, NormClipper
from ._optax import per_example_global_norm_clip, per_example_layer_norm_clip
from ._partial import CorruptStateError, OverlapError, PartialState
from ._policy import BoundKind, ClipPolicy, LayerSpec, NonFinite
from ._unit import Unit, client_contribution, contribution_rows
from ._xla_cpu import CHUNK_ELEMENTS, Tricks, sum_buffer_runs

__all__ = [
    "AccumulatorState",
    "FIXED_POINT_DELTA_ROWS",
    "CHUNK_ELEMENTS",
    "BoundKind",
    "ClipAccumulator",
    "ExampleScales",
    "ClipPolicy",
    "ConstantFlatClipper",
    "ConstantPerLayerClipper",
    "CorruptStateError",
    "OverlapError",
    "PartialState",
    "L2Clipping",
    "L2GlobalClipping",
    "LayerSpec",
    "NUM_BUCKETS",
    "NonFinite",
    "NormClipper",
    "RATIO_BUCKETS",
    "add_example",
    "clip_pytree",
    "merge",
    "multiplier",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
    "sum_buffer_runs",
    "Tricks",
    "Unit",
    "client_contribution",
    "contribution_rows",
]
