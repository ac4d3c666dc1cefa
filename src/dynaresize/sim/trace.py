"""Trace files for the simulator: the format and loader live in `dynaresize.workload.trace`
(shared with the runtime); this module re-exports them for the simulator's callers."""

from dynaresize.workload.trace import (DEFAULT_PROMPT_TOKENS, Batch, load_trace, load_trace_steps,
                                       parse_trace_lines, parse_trace_steps, write_trace)

__all__ = ["DEFAULT_PROMPT_TOKENS", "Batch", "load_trace", "load_trace_steps", "parse_trace_lines",
           "parse_trace_steps", "write_trace"]
