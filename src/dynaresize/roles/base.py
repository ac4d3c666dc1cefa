"""The narrow interfaces of the roles a device worker can hold, and the plain data they exchange.

Invariants:
- `GenRequest` and `GenResult` are plain data (ints, floats, lists, tuples): they pickle across
  Ray and carry no tensors.
- A `RolloutEngine` generates a sample's tokens from (weights, prompt ids, seed,
  forced_length) alone: never from the device, the engine instance or the other requests of a
  call. `version` tags every result with the policy version of the weights that produced it.
- `release()` frees the engine's memory (model, caches); `set_weights` after a release loads
  the model again. `loaded` says which of the two states the engine is in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

SampleId = tuple[int, int, int]


@dataclass(frozen=True)
class GenRequest:
    sample_id: SampleId  # (step, prompt_index, sample_index)
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int  # rl.seeds.sample_seed(run_seed, *sample_id)
    forced_length: int | None = None  # synthetic-length mode: ignore EOS, stop at exactly this many


@dataclass(frozen=True)
class GenResult:
    sample_id: SampleId
    response_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the sampling distribution (temperature applied)
    version: int  # optimizer steps applied to the weights that generated it
    duration_s: float  # wall time from the start of its batch to its last token


@runtime_checkable
class RolloutEngine(Protocol):
    @property
    def loaded(self) -> bool: ...

    def set_weights(self, state_dict: Mapping[str, Any], version: int) -> None: ...

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]: ...

    def release(self) -> None: ...


def build_rollout_engine(backend: str, model_cfg, temperature: float, **kwargs: Any) -> RolloutEngine:
    """The rollout engine for `backend` (RolloutConfig.backend); backends import lazily."""
    from dynaresize.errors import UserError

    if backend == "hf":
        from dynaresize.roles.rollout_hf import HFRolloutEngine

        return HFRolloutEngine(model_cfg, temperature, **kwargs)
    raise UserError(f"rollout.backend={backend!r}: not available in this build (available: hf)")
