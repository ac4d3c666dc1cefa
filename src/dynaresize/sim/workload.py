"""Response-length workloads for the simulator: the model lives in `dynaresize.workload.lengths`
(shared with the runtime, keyed by absolute step); this module re-exports it."""

from dynaresize.workload.lengths import (WORKLOADS, WorkloadSpec, get_workload, sample_lengths,
                                         sample_lengths_array)

__all__ = ["WORKLOADS", "WorkloadSpec", "get_workload", "sample_lengths", "sample_lengths_array"]
