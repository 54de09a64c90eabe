"""Training strategies: data parallel, pipeline (model/hybrid), pipe-sgd. Each module named in the strategy
table (``mpitrain._registry.STRATEGIES``) exposes ``make_trainer(model, loss_fn, optimizer, comm, spec) -> Trainer``;
what they share lives in :mod:`.base`.

The helpers other packages use (fit, checkpoint, the planner, spatial, horovod, the benchmarks) are exported
here; the private modules that define them serve strategies alone (docs/ARCHITECTURE.md, Import rules)."""

from ._batching import (
    ACCEPTED,
    DEFAULT_IGNORE_INDEX,
    EVERY_COLUMN,
    LABEL_KEYS,
    Columns,
    counted,
    ignore_index_of,
    label_shift,
    plain_inputs,
    rows,
    samples,
    slice_share,
    split_batch,
    target_rows,
    used_columns,
)
from ._broadcast import broadcast_optimizer_state, broadcast_tensors
from ._buckets import MB, Bucket, plan_buckets
from ._device import as_float, autocast, model_device, to_device
from ._optimizer import optimizer_factory, probe_optimizer
from ._reshard import NAMED, assemble, load_replica, replica_entries
from ._scaler import LossScaler
from .base import FitError, FitSpec, StrategyOptions, Trainer
from .step import StepTrainer

__all__ = ["FitError", "FitSpec", "StrategyOptions", "Trainer", "StepTrainer", "ACCEPTED", "split_batch",
           "plain_inputs", "Columns", "EVERY_COLUMN", "LABEL_KEYS", "used_columns", "DEFAULT_IGNORE_INDEX", "counted",
           "ignore_index_of", "label_shift",
           "rows", "samples", "slice_share", "target_rows", "broadcast_optimizer_state", "broadcast_tensors",
           "MB", "Bucket", "plan_buckets", "as_float", "autocast", "model_device", "to_device", "NAMED", "assemble",
           "replica_entries", "load_replica", "optimizer_factory", "probe_optimizer", "LossScaler"]
