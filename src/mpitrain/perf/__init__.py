"""Performance models: Pipe-SGD's timing model (eqs. 2-7), alpha/beta/gamma calibration (and `spatial`)."""

from .calibrate import Calibration, calibrate
from .timing import TimingInputs, predict, ring_allreduce_time, scaling_efficiency

__all__ = ["TimingInputs", "predict", "ring_allreduce_time", "scaling_efficiency", "Calibration", "calibrate"]
