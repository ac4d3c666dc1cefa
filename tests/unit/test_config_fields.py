"""No accepted-but-ignored config (issue 8 item 5): every leaf field of `RunConfig` changes
behaviour, or is refused with a clear error where this build does not support it.

`EVIDENCE` maps every field path (as `_paths` walks `RunConfig`, like test_docs_config.py) to
one or more pieces of evidence; a field without an entry fails `test_every_field_has_evidence`,
so a new field must come with its proof. Kinds of evidence:

- `Probe(alt, fn, base)`: `fn(cfg)` is an observable computed by the product code that
  consumes the field (the job's requests and scores, the runtime's controller, the trainer's
  own step functions, the rollout engine, the watchdog, the cluster start, ...). The test
  builds the default config (preset `default` + the tiny model below + `base`) and the same
  with the field set to `alt`, and asserts the observable differs, after checking it is
  reproducible (the default built twice gives the same observable, so a difference is the
  field's, not noise).
- `Refused(value, fragment, via)`: building the config (or, with `via`, the consumer that
  meets the field first) raises a `UserError` (ConfigError and friends) whose message holds
  `fragment`, which names the field, for a value this build does not support.
- `Runtime(test, asserts)`: an existing test elsewhere (most run the real runtime on Ray
  workers) that asserts the field's effect; here only its existence is checked (parsed with
  `ast`, no import). Every field also has a probe or a refusal; these say where the live
  effect is checked too.

Fields that could be proven neither way would go in `UNPROVEN` (with a reason), and
`test_unproven_is_exactly_known` pins that set, so it cannot grow silently.

Runtime-only fields are probed through their pure consumers: `Cluster.start` with Ray's entry
points replaced by recorders (cluster.address/backend/cpus_per_device/torch_threads/
placement_strategy), the watchdog's verdicts with a Ray stand-in that never answers
(timeouts.*), the `Checkpointer`'s periodic rule and its directory (checkpoint.dir), the
evaluator's schedule, requests and record (eval.*), the tracker factory `open_sinks`, `reshard` with `dist.send` recorded, the
resize executor's moment handler with a fake cluster, and one training step of
`FSDPTrainer.compute_grads` + `apply_optimizer` run unbound on a single-rank stand-in for the
FSDP state (no process group), with the worker's own loss function.

Pure: no Ray, no process group, no network. Tiny model (hidden 32, one layer, vocab 600).
"""

from __future__ import annotations

import ast
import atexit
import functools
import hashlib
import importlib.util
import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable
from unittest import mock

import pytest
import torch

from dynaresize.config import RunConfig
from dynaresize.cluster.worker import worker_config
from dynaresize.config_load import build_config, merge
from dynaresize.emulate.model import run_bounds
from dynaresize.errors import DynaresizeError, UserError
from dynaresize.presets import preset

ROOT = Path(__file__).resolve().parents[2]
TINY = {"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "vocab_size": 600}}


# ---------------------------------------------------------------- the walk


def _paths(cls, prefix=""):
    from dynaresize.config_load import field_paths

    return field_paths(cls, prefix)


class Lazy:
    """A value made when a test needs it (a file the alternative value names)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make

    def __repr__(self) -> str:
        return f"Lazy({self.make.__name__})"


def _resolve(value: Any) -> Any:
    if isinstance(value, Lazy):
        return value.make()
    if isinstance(value, dict):
        return {k: _resolve(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Probe:
    alt: Any  # the alternative value (a Lazy: made on use)
    fn: Callable[[RunConfig], Any]  # observable computed by the field's consumer
    base: dict = field(default_factory=dict)  # context applied to both sides (the mode the field belongs to)


@dataclass(frozen=True)
class Refused:
    value: Any
    fragment: str  # in the error message; names the field
    via: Callable[[RunConfig], Any] | None = None  # None: build_config refuses
    base: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Runtime:
    test: str  # tests/...py::function
    asserts: str  # what it asserts about the field


def _nested(path: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def _data(*layers: dict) -> dict:
    data = merge(preset("cpu"), TINY)
    for layer in layers:
        data = merge(data, _resolve(layer))
    return data


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().to(torch.float64).contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- files some values name


@functools.lru_cache(maxsize=None)
def _files() -> Path:
    """A prompt file, reward plug-ins and an HF model folder (with a chat template)."""
    from dynaresize.config import ModelConfig
    from dynaresize.rl.models import build_model, build_tokenizer, save_hf

    d = Path(tempfile.mkdtemp(prefix="dynaresize-fields-"))
    atexit.register(shutil.rmtree, d, True)
    (d / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"say words that start with {c} please", "letter": c}) + "\n" for c in "dkmst"))
    (d / "rewards.py").write_text(
        "def length_reward(prompt, response, fields):\n    return float(len(response))\n\n"
        "def broken_reward(prompt, response, fields):\n    raise RuntimeError('broken on purpose')\n")
    tok = build_tokenizer(600)
    tok.chat_template = ("{% for m in messages %}<bos>{{ m['role'] }} : {{ m['content'] }}<eos>{% endfor %}"
                         "{% if add_generation_prompt %}<bos>assistant :{% endif %}")
    save_hf(build_model(ModelConfig(hidden_size=48, num_layers=1, num_heads=2, num_kv_heads=2, vocab_size=600,
                                    init_seed=7)), tok, d / "hf")
    return d


HF_DIR = Lazy(lambda: str(_files() / "hf"))
PROMPTS_FILE = Lazy(lambda: str(_files() / "prompts.jsonl"))
LENGTH_REWARD = Lazy(lambda: f"{_files() / 'rewards.py'}:length_reward")
BROKEN_REWARD = Lazy(lambda: f"{_files() / 'rewards.py'}:broken_reward")
CHECKPOINT_DIR = Lazy(lambda: str(_files() / "shared-checkpoints"))
EVAL_BASE = {"eval": {"every_steps": 2}}  # evaluation on: the mode the other eval fields belong to
LORA_BASE = {"train": {"lora": {"rank": 2}}}  # LoRA on: the mode the other train.lora fields belong to
LORA_RUN = "tests/e2e/test_lora_run.py::test_moves_and_syncs_carry_the_adapter_only"


@functools.lru_cache(maxsize=None)
def _task_files() -> Path:
    """A verl-schema parquet with chat prompts, a JSONL with two prompt columns, and rewards
    of each style (task.dataset, task.columns, task.reward_style, task.reward_timeout_s)."""
    from dynaresize.rl.dataset import write_parquet

    d = _files() / "task"
    d.mkdir(exist_ok=True)
    write_parquet([{"data_source": "s", "prompt": [{"role": "user", "content": f"what is {a} plus {a} ?"}],
                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
                    "extra_info": {"index": a}} for a in range(5)], d / "verl.parquet")
    (d / "qa.jsonl").write_text("".join(json.dumps({"prompt": f"say {c} words", "question": f"which words start "
                                                    f"with {c} ?"}) + "\n" for c in "dkmst"))
    (d / "rewards.py").write_text(
        "import time\n\n"
        "def verl_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n\n"
        "def any_style(*args, **kwargs):\n    return float(len(kwargs))  # dynaresize: 0, verl: 4 keywords\n\n"
        "def nap(prompt, response, fields):\n    if 'kuta' in response:\n        time.sleep(0.4)\n"
        "    return 1.0\n")
    return d


def _reward_workers(cfg: RunConfig) -> int:
    """The reward pool the job starts: how many worker processes (`Job.reward_pool`)."""
    from dynaresize.driver.job import Job

    job = Job(cfg)
    try:
        pool = job.reward_pool()
        pool.start()
        return len(set(pool.pids()))
    finally:
        job.close()


VERL_PARQUET = Lazy(lambda: str(_task_files() / "verl.parquet"))
QA_FILE = Lazy(lambda: str(_task_files() / "qa.jsonl"))
VERL_REWARD = Lazy(lambda: f"{_task_files() / 'rewards.py'}:verl_score")
ANY_STYLE_REWARD = Lazy(lambda: f"{_task_files() / 'rewards.py'}:any_style")
NAP_REWARD = Lazy(lambda: f"{_task_files() / 'rewards.py'}:nap")


# ---------------------------------------------------------------- probes: the job (driver side)


def _requests(cfg: RunConfig) -> list:
    """`Job.requests(0)`: prompt ids, max_new_tokens, seeds, forced lengths of step 0."""
    from dynaresize.driver.job import Job

    return [[(r.sample_id, tuple(r.prompt_ids), r.max_new_tokens, r.seed, r.forced_length) for r in g]
            for g in Job(cfg).requests(0)]


def _lengths_later(cfg: RunConfig) -> list:
    """The forced lengths of step 5 (a workload's time constants show after step 0)."""
    from dynaresize.driver.job import Job

    return [r.forced_length for g in Job(cfg).requests(5) for r in g]


def _scores(cfg: RunConfig) -> Any:
    """`Job.score` of step 0 on fixed responses: rewards (via the ledger), advantages; or the
    error it stops with."""
    from dynaresize.driver.job import Job
    from dynaresize.driver.ledger import Ledger
    from dynaresize.roles.base import GenResult

    job = Job(cfg)
    words = [" bako bemi", " the word", " kuta", " bote bado bemi"]
    results = []
    for g in job.requests(0):
        for r in g:
            ids = job.tokenizer(words[r.sample_id[2] % len(words)])["input_ids"]
            results.append((0, GenResult(sample_id=r.sample_id, response_ids=list(ids), logprobs=[-1.0] * len(ids),
                                         version=0, duration_s=0.0)))
    ledger = Ledger(staleness=cfg.train.staleness)
    try:
        scored = job.score(0, results, ledger)
    except DynaresizeError as exc:
        return type(exc).__name__, str(exc)
    return ([(sid, e.reward, e.reward_error) for sid, e in sorted(ledger.entries.items())],
            [round(s.advantage, 9) for s in scored.samples])


# ---------------------------------------------------------------- probes: the controller


# Rollout work (device-seconds) of each step: drifting levels with jitter (fixed numbers, found
# by a search), so the default hysteresis policy moves both ways and each of its settings changes
# some decision. A change to the policy's internals may need a new sequence (or other alternative
# values): a probe that sees no change fails, it never passes silently.
ROLLOUT_WORK = [34.51, 10.65, 12.08, 11.15, 10.68, 10.3, 10.96, 17.3, 17.11, 17.07, 16.45, 17.83, 16.07, 16.55,
                17.89, 17.35, 16.31, 17.37, 17.29, 15.72, 16.07, 17.24, 15.99, 15.91, 16.52, 15.01, 15.62, 18.0,
                15.58, 17.41]
POLICY_BASE = {"cluster": {"devices": 6, "rollout_devices": 2}}


def _decisions(cfg: RunConfig) -> list:
    """The runtime's own controller (`Run._controller`: bounds, `make_policy`, initial split)
    fed a fixed sequence of step reports (times from ROLLOUT_WORK at the current split, the
    measured cost of each move reported after it); its commands, as a trace."""
    from dynaresize.control.controller import decision_fields
    from dynaresize.control.state import Refusal
    from dynaresize.driver.run import Run
    from dynaresize.types import ResizePlan, StepReport

    run = Run.__new__(Run)
    run.cfg = cfg
    ctl, assignment = run._controller({})
    out: list = [assignment.roles]
    crit, now = None, 0.0
    for k in range(min(cfg.steps, len(ROLLOUT_WORK))):
        r = ctl.assignment.num_rollout
        n = ctl.assignment.num_devices - r
        roll, train = 0.5 + ROLLOUT_WORK[k] / r, 0.2 + 12.0 / n
        now += max(roll, train) + 0.1
        report = StepReport(step=k, now_s=now, num_rollout=r, num_train=n, rollout_s=roll, train_s=train, sync_s=0.1,
                            rollout_floor_s=0.5, resize_critical_s=crit)
        crit = None
        for cmd in ctl.on_report(report):
            if isinstance(cmd, ResizePlan):
                ctl.on_resize_done(cmd.resize_id, 0.3, 0.5)
                crit = 0.3
                out.append((k, "move", cmd.dst.num_rollout))
            elif isinstance(cmd, Refusal):
                out.append((k, "refused", cmd.requested_rollout))
        if decision_fields(ctl)["action"] == "suppressed":
            out.append((k, "suppressed"))
    return out


# ---------------------------------------------------------------- probes: the trainer


class _LocalShard:
    """One parameter seen as FSDP2's DTensor on a single rank (`to_local()` is the whole
    tensor), so `FSDPTrainer`'s own step code runs unbound without a process group."""

    def __init__(self, p: torch.nn.Parameter) -> None:
        self.p = p

    def to_local(self) -> torch.Tensor:
        return self.p

    @property
    def grad(self) -> Any:
        g = self.p.grad
        return None if g is None else SimpleNamespace(to_local=lambda: g)

    @grad.setter
    def grad(self, value: Any) -> None:
        self.p.grad = value


def _train_samples(cfg: RunConfig) -> list:
    from dynaresize.rl import grpo

    out = []
    for i in range(8):
        resp = [(37 * i + 11 * j) % (cfg.model.vocab_size - 10) + 4 for j in range(6)]
        out.append(grpo.TrainSample(sample_id=(0, i // 4, i % 4), prompt_ids=[2, 5 + i, 6, 7], response_ids=resp,
                                    rollout_logprobs=[-3.0] * len(resp), advantage=1.0 if i % 3 else -1.5))
    return out


def _train_steps(cfg: RunConfig, steps: int = 2) -> list:
    """Two optimizer steps of `FSDPTrainer.compute_grads` + `apply_optimizer` (unbound, on a
    single-rank stand-in) with `TrainerSpec.from_config(cfg)` and the worker's own loss
    function (`DeviceWorker._loss_fn`: clip_eps, kl_coef, kl_estimator, temperature); the
    reference model held iff the spec says so. Returns each step's stats and the weights."""
    from dynaresize.cluster.worker import DeviceWorker
    from dynaresize.rl import grpo
    from dynaresize.rl.models import build_model
    from dynaresize.roles.train_fsdp import FSDPTrainer
    from dynaresize.roles.train_spec import MOMENT_KINDS, TrainerSpec

    spec = TrainerSpec.from_config(cfg)
    model = build_model(cfg.model).train()
    for p in model.parameters():
        p.requires_grad_(True)
    ref = build_model(cfg.model) if spec.with_ref else None
    params = list(model.parameters())
    fake = SimpleNamespace(spec=spec, ranks=(0,), index=0, rank=0, device=torch.device("cpu"), step=0, lr_step=0,
                           model=model, ref=ref, params=[_LocalShard(p) for p in params], pending=set(),
                           moments={k: [torch.zeros_like(p) for p in params] for k in MOMENT_KINDS},
                           _grad_coef=None, group=None)
    fake._rng = lambda i: FSDPTrainer._rng(fake, i)
    for name in ("begin_grads", "add_grads", "reduce_grads"):
        setattr(fake, name, getattr(FSDPTrainer, name).__get__(fake))
    fake._reshard_roots = lambda: None
    fake.state_bytes = lambda: 0
    worker = DeviceWorker.__new__(DeviceWorker)
    worker._parked = None  # set by __init__, which these probes skip
    worker.cfg, worker.trainer = cfg, fake
    samples = _train_samples(cfg)
    mbs = grpo.micro_batches(samples, cfg.train.micro_batch_size)
    total = grpo.total_response_tokens(samples)
    out: list = []
    for _ in range(steps):
        stats = FSDPTrainer.compute_grads(fake, list(enumerate(mbs)), worker._loss_fn(total, None),
                                          num_micro_batches=len(mbs))
        stats.update(FSDPTrainer.apply_optimizer(fake))
        out.append({k: stats[k] for k in ("loss", "grad_norm", "clip_coef", "entropy", "kl", "clip_frac",
                                          "num_micro_batches", "lr")})
    out.append(_digest(*params))
    return out


def _lora_forward(cfg: RunConfig) -> tuple:
    """The trainers' LoRA policy (`lora_model.wrap` of the model, in train mode) with the run's
    step-0 adapter (`initial_adapter`) and lora_B set to a fixed non-zero value (as training
    makes it): the adapter's wire names and shapes, and the logits of a fixed input under a
    fixed dropout seed."""
    from dynaresize.rl.models import build_model
    from dynaresize.roles.lora_model import initial_adapter, trainable_specs, wire_name, wrap

    specs = trainable_specs(cfg.model, cfg.train.lora)
    start = initial_adapter(specs, cfg.seed)
    model = wrap(build_model(cfg.model), cfg.train.lora).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (w := wire_name(name)) is not None:
                p.copy_(start[w] if w.endswith("lora_A") else torch.full_like(p, 0.02))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        logits = model(input_ids=torch.tensor([[5, 9, 17, 33, 2]])).logits
    return tuple(specs), _digest(logits)


def _loss_terms(cfg: RunConfig) -> tuple:
    """The worker's own loss function (`DeviceWorker._loss_fn`) over the samples of
    `_train_samples` with behaviour log-probs below the model's (every ratio ~5 > 1 + any clip,
    where `_train_steps`' are all below 1 - clip): the step's loss and its gradient."""
    import dataclasses

    from dynaresize.cluster.worker import DeviceWorker
    from dynaresize.rl import grpo
    from dynaresize.rl.models import build_model

    model = build_model(cfg.model)
    worker = DeviceWorker.__new__(DeviceWorker)
    worker._parked = None  # set by __init__, which these probes skip
    worker.cfg, worker.trainer = cfg, SimpleNamespace(ref=None)
    samples = [dataclasses.replace(s, rollout_logprobs=[-8.0] * len(s.response_ids)) for s in _train_samples(cfg)]
    fn = worker._loss_fn(grpo.total_response_tokens(samples))
    total = 0.0
    for mb in grpo.micro_batches(samples, cfg.train.micro_batch_size):
        loss, _ = fn(model, mb)
        loss.backward()
        total += loss.item()
    return round(total, 6), _digest(*(p.grad for p in model.parameters() if p.grad is not None))


def _head_outputs(cfg: RunConfig) -> tuple:
    """Shapes the output head returns inside the worker's own loss function: the whole logits
    [micro-batch, positions, vocabulary], or in chunks (rl/logprobs.py) per-position pairs."""
    from dynaresize.cluster.worker import DeviceWorker
    from dynaresize.rl import grpo
    from dynaresize.rl.models import build_model

    model = build_model(cfg.model)
    shapes: list = []
    model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape)))
    worker = DeviceWorker.__new__(DeviceWorker)
    worker._parked = None  # set by __init__, which these probes skip
    worker.cfg, worker.trainer = cfg, SimpleNamespace(ref=None)
    samples = _train_samples(cfg)
    fn = worker._loss_fn(grpo.total_response_tokens(samples))
    for mb in grpo.micro_batches(samples, cfg.train.micro_batch_size):
        fn(model, mb)
    return tuple(shapes)


class _Mesh:
    @staticmethod
    def from_group(group: Any, device_type: str) -> None:
        return None


def _sharded(cfg: RunConfig) -> tuple:
    """`FSDPTrainer._shard` (unbound; `fully_shard` and the device mesh recorded instead of
    run): master weight dtype, FSDP's mixed-precision policy, activation checkpointing."""
    import torch.distributed.fsdp as fsdp

    from dynaresize.rl.models import build_model
    from dynaresize.roles.train_fsdp import FSDPTrainer
    from dynaresize.roles.train_spec import TrainerSpec

    policies: list = []

    def fully_shard(module: Any, *, mesh: Any, mp_policy: Any) -> Any:
        policies.append((mp_policy.param_dtype, mp_policy.reduce_dtype))
        return module

    fake = SimpleNamespace(spec=TrainerSpec.from_config(cfg), group=None, device=torch.device("cpu"))
    with mock.patch.object(fsdp, "fully_shard", fully_shard), \
            mock.patch("torch.distributed.device_mesh.DeviceMesh", _Mesh):
        model = FSDPTrainer._shard(fake, build_model(cfg.model), trainable=True)
    on = "is_activation_checkpointing"
    if not hasattr(type(model), on):  # transformers 4.x
        on = "is_gradient_checkpointing"
    return next(model.parameters()).dtype, sorted(set(map(str, policies))), getattr(model, on)


def _behaviour_logprobs(cfg: RunConfig) -> tuple:
    """`DeviceWorker._old_logprobs()` (where the PPO ratio's behaviour log-probs come from)
    and the compute dtype of the spec."""
    from dynaresize.cluster.worker import DeviceWorker
    from dynaresize.roles.train_spec import TrainerSpec

    worker = DeviceWorker.__new__(DeviceWorker)
    worker._parked = None  # set by __init__, which these probes skip
    worker.cfg = cfg
    return worker._old_logprobs(), TrainerSpec.from_config(cfg).compute_dtype


# ---------------------------------------------------------------- probes: the rollout engine


def _generated(cfg: RunConfig) -> tuple:
    """The worker's engine (`DeviceWorker._new_engine`) with the initial weights: its batches
    for 8 requests and the tokens and log-probs it samples."""
    from dynaresize.cluster.worker import DeviceWorker
    from dynaresize.rl.models import build_model
    from dynaresize.roles.base import GenRequest

    worker = DeviceWorker.__new__(DeviceWorker)
    worker._parked = None  # set by __init__, which these probes skip
    worker.cfg, worker.torch_device = cfg, torch.device("cpu")
    engine = worker._new_engine()
    engine.set_weights(build_model(cfg.model).state_dict(), 0)
    reqs = [GenRequest(sample_id=(0, i // 2, i % 2), prompt_ids=[2, 5, 6, 7], max_new_tokens=4, seed=100 + i)
            for i in range(8)]
    res = engine.generate(reqs)
    return engine._batches(reqs), [(tuple(r.response_ids), tuple(r.logprobs)) for r in res]


HAVE_VLLM = importlib.util.find_spec("vllm") is not None
VLLM_MODEL = {"model": {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1}}  # head size 32: vLLM's minimum


def _engine_class(cfg: RunConfig) -> str:
    """The class of the engine the worker builds (`DeviceWorker._new_engine`)."""
    return type(_new_engine(cfg)).__name__


def _vllm_kwargs(cfg: RunConfig) -> dict:
    """The `vllm.LLM` arguments `roles.factory.rollout_engine_from_config` gives a vLLM engine
    (built, not started: no vllm import), for a run whose engine resolved to vllm."""
    from unittest import mock

    from dynaresize.roles import base, factory

    with mock.patch.object(base, "resolve_engine", lambda c: "vllm"):
        return factory.rollout_engine_from_config(cfg).engine_kwargs()


def _vllm_kwargs_on_cuda(cfg: RunConfig) -> dict:
    """`_vllm_kwargs` as a worker holding a GPU builds them (CUDA seen as available)."""
    from unittest import mock

    with mock.patch("torch.cuda.is_available", lambda: True):
        return _vllm_kwargs(cfg)


def _release_engine(cfg: RunConfig) -> tuple:
    """`DeviceWorker.release_engine` on a loaded engine: whether memory was freed, and whether
    the engine is still loaded (kept warm) afterwards."""
    from dynaresize.cluster.worker import DeviceWorker
    from dynaresize.rl.models import build_model

    worker = DeviceWorker.__new__(DeviceWorker)
    worker._parked = None  # set by __init__, which these probes skip
    worker.cfg, worker.torch_device, worker._faults, worker._parked = cfg, torch.device("cpu"), [], None
    engine = worker.engine = _new_engine(cfg)
    engine.set_weights(build_model(cfg.model).state_dict(), 0)
    out = worker.release_engine(0)
    return out["memory_freed"], engine.loaded, worker._parked is engine


def _sync_mode(cfg: RunConfig) -> str:
    """How the worker's `sync_weights` sends weights to its engines (roles/delta_sync.py
    `resolve_mode` of the field, for the engine's dtype `_wire_dtype` resolves)."""
    from dynaresize.cluster.worker import DeviceWorker
    from dynaresize.roles.delta_sync import resolve_mode

    worker = DeviceWorker.__new__(DeviceWorker)
    worker.cfg, worker.torch_device = cfg, torch.device("cpu")
    return resolve_mode(cfg.rollout.weight_sync, worker._wire_dtype())


def _new_engine(cfg: RunConfig) -> Any:
    from dynaresize.cluster.worker import DeviceWorker

    worker = DeviceWorker.__new__(DeviceWorker)
    worker._parked = None  # set by __init__, which these probes skip
    worker.cfg, worker.torch_device = cfg, torch.device("cpu")
    return worker._new_engine()


# ---------------------------------------------------------------- probes: the model


def _model(cfg: RunConfig) -> tuple:
    """`build_model` + `load_tokenizer`: parameter names and shapes, logits on a fixed input,
    tokenizer size."""
    from dynaresize.rl.models import build_model, load_tokenizer

    model = build_model(cfg.model)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[2, 5, 6, 7]])).logits
    return ([(n, tuple(p.shape)) for n, p in model.named_parameters()], _digest(logits),
            len(load_tokenizer(cfg.model)))


# ---------------------------------------------------------------- probes: the cluster (driver side)


class _Stop(Exception):
    pass


def _cluster_start(cfg: RunConfig) -> dict:
    """`Cluster.start` with Ray's entry points recorded: what it asks `ray.init`, the placement
    group and the actor options (resources, environment) for."""
    import ray

    from dynaresize.cluster import cluster as cl
    from dynaresize.types import Assignment

    calls: dict = {}

    class Actor:
        def options(self, **kw: Any) -> Any:
            calls["actor"] = {k: v for k, v in kw.items() if k != "scheduling_strategy"}
            raise _Stop

    def placement(n: int, **kw: Any) -> Any:
        calls["placement_group"] = (n, kw)
        return SimpleNamespace(bundle_count=n, id=None)

    c = cl.Cluster(cfg)
    with mock.patch.object(ray, "is_initialized", lambda: False), \
            mock.patch.object(ray, "init", lambda **kw: calls.setdefault("ray.init", kw)), \
            mock.patch.object(ray, "cluster_resources", lambda: {"CPU": 4.0}), \
            mock.patch.object(cl, "make_placement_group", placement), \
            mock.patch.object(cl, "remote_worker_class", Actor):
        try:
            c.start(Assignment.split(cfg.cluster.devices, cfg.cluster.rollout_devices))
        except _Stop:
            pass
        finally:
            c._started_ray, c._pg = False, None
            c.stop()
    return calls


class _SilentRay:
    """Ray as the watchdog sees it when no call and no ping ever answers."""

    exceptions = SimpleNamespace(RayActorError=type("RayActorError", (Exception,), {}))

    @staticmethod
    def wait(refs: list, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        return [], list(refs)


def _watchdog(cfg: RunConfig) -> list:
    """The verdicts of the cluster's watchdog (built by `Cluster(cfg)`) on a call to one
    worker that never returns: a started worker silent for 700 s, a worker busy for 1000 s."""
    from dynaresize.cluster import cluster as cl
    from dynaresize.cluster import watchdog as wd

    c = cl.Cluster(cfg)
    c.stop()
    dog = c.watchdog
    dog.ping = lambda rank: object()
    out = []
    with mock.patch.object(wd, "ray", _SilentRay):
        for seen, age in ((True, 700.0), (False, 1000.0)):
            dog.lost.clear()
            dog.seen = {0} if seen else set()
            tracker = dog.tracker("probe")
            tracker.t_start = time.time() - age
            _, lost = tracker.poll({object(): 0})
            why = lost.get(0, "alive")
            out.append("stopped" if why.startswith("no answer") else "deadline" if why.startswith("no result")
                       else why)
    return out


def _faults(cfg: RunConfig) -> tuple:
    """The cluster's fault injector (`Cluster(cfg).faults`): which device it tells to fire when
    the run reaches training step 2 on devices that do not include it, and what stays unfired."""
    from dynaresize.cluster import cluster as cl

    c = cl.Cluster(cfg)
    c.stop()
    told: list = []
    worker = SimpleNamespace(fault_now=SimpleNamespace(remote=lambda kind: told.append(kind)))
    c.faults.reach("train", 2, participants=[], worker_of=lambda d: told.append(d) or worker, alive=lambda d: True)
    return told, c.faults.unfired()


def _checkpoints(cfg: RunConfig) -> list:
    """The boundaries `Checkpointer.periodic` saves at over the run (saves recorded)."""
    from dynaresize.driver.checkpointing import Checkpointer

    saved: list = []

    class Recording(Checkpointer):
        def save(self, boundary: int, kind: str, **kw: Any) -> None:
            saved.append((boundary, kind))

    ck = Recording(SimpleNamespace(cfg=cfg, out=Path("/nonexistent-run-dir")))
    for boundary in range(1, cfg.steps + 1):
        ck.periodic(boundary)
    return saved


def _snapshot_kinds(cfg: RunConfig) -> list:
    """Which versions the driver snapshots in full over the run (driver/snapshots.py `kind_for`)."""
    from dynaresize.driver.snapshots import Snapshots

    snaps = Snapshots(SimpleNamespace(cfg=cfg))
    return [snaps.kind_for(v) for v in range(1, cfg.steps + 1)]


def _young_daly(cfg: RunConfig) -> int:
    """The K the driver chooses for a 0.05 s full snapshot and 1 s steps (costmodel/snapshot_interval.py)."""
    from dynaresize.costmodel.snapshot_interval import snapshot_every

    return snapshot_every(cfg.checkpoint.snapshot_every_steps, 0.05, cfg.checkpoint.mtbf_s, 1.0)


def _checkpoint_root(cfg: RunConfig) -> str:
    """Where `Checkpointer` puts the run's checkpoints (`checkpoint.dir`, else RUN_DIR/checkpoint)."""
    from dynaresize.driver.checkpointing import Checkpointer

    return str(Checkpointer(SimpleNamespace(cfg=cfg, out=Path("/nonexistent-run-dir"))).root)


def _eval(cfg: RunConfig) -> tuple:
    """`Evaluator`: the steps it evaluates after, its requests, and its `eval` record for fixed
    responses (per prompt: one sample all of the prompt's letter, the others a third of it)."""
    from dynaresize.driver.evaluation import Evaluator
    from dynaresize.driver.job import Job
    from dynaresize.rl.models import pseudo_words
    from dynaresize.roles.base import GenResult

    job = Job(cfg)
    ev = Evaluator(cfg, job)
    due = [s for s in range(cfg.steps) if ev.due(s)]
    if not ev.enabled:
        return due, None, None
    groups = ev._requests()
    requests = [[(r.sample_id, tuple(r.prompt_ids), r.max_new_tokens, r.seed) for r in g] for g in groups]
    results = []
    for g in groups:
        for r in g:
            letter = ev.prompts[r.sample_id[1]]["letter"]
            mine = [w for w in pseudo_words() if w[0] == letter][:2]
            other = [w for w in pseudo_words() if w[0] != letter][:2]
            text = " ".join(mine) if r.sample_id[2] == 0 else " ".join([mine[0], *other])
            ids = list(job.tokenizer(" " + text)["input_ids"])
            results.append(GenResult(sample_id=r.sample_id, response_ids=ids, logprobs=[0.0] * len(ids), version=1,
                                     duration_s=0.0))
    return due, requests, sorted(ev.score(0, results).items())


def _sinks(cfg: RunConfig) -> list:
    """The tracker sinks `open_sinks(cfg.logging.backends, run_dir)` opens."""
    from dynaresize.tracking import open_sinks

    d = Path(tempfile.mkdtemp(prefix="dynaresize-sinks-"))
    try:
        sinks = open_sinks(cfg.logging.backends, d)
        names = [type(s).__name__ for s in sinks]
        for s in sinks:
            s.close()
        return names
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _staleness(cfg: RunConfig) -> tuple:
    """The weights version generating each step (`rollout_version`, as the runtime calls it)
    and the ledger's verdict (`Ledger(staleness=...)`) on a sample of step 1 made by version 0."""
    from dynaresize.driver.ledger import Ledger
    from dynaresize.pipeline.stepstate import rollout_version

    ledger = Ledger(staleness=cfg.train.staleness)
    ledger.expect(1, [(1, 0, 0)])
    ledger.generated(sample_id=(1, 0, 0), version=0, device=0, num_tokens=3, token_sha1="x", seed=1)
    ledger.consumed((1, 0, 0), 1)
    return [rollout_version(k, cfg.train.staleness) for k in range(4)], ledger.check()


def _reshard(cfg: RunConfig) -> tuple:
    """`reshard` of a trainer's param and moments from 1 to 2 ranks, as rank 0 runs it with
    `staging_bytes=cfg.reshard.staging_bytes` (the worker's call); messages recorded."""
    from dynaresize.reshard import execute
    from dynaresize.reshard.layout import FlatLayout

    sent: list = []
    def batch_isend_irecv(ops: list) -> list:  # reshard messages are batched P2P ops (execute._p2p)
        sent.extend(t.numel() for op, t in ops if op == "isend")
        return []

    fake_dist = SimpleNamespace(isend="isend", irecv="irecv", P2POp=lambda op, t, peer, group=None: (op, t),
                                batch_isend_irecv=batch_isend_irecv)
    state = {k: torch.arange(4096, dtype=torch.float32) for k in ("param", "exp_avg", "exp_avg_sq")}
    with mock.patch.object(execute, "dist", fake_dist):
        _, stats = execute.reshard(state, old_layout=FlatLayout(4096, (0,)), new_layout=FlatLayout(4096, (0, 1)),
                                   rank=0, staging_bytes=cfg.reshard.staging_bytes)
    return sent, stats.peak_staging_bytes


def _moments(cfg: RunConfig) -> tuple:
    """The resize executor's optimizer-moment handler (`resize_ops.HANDLERS`) on the run's
    `Cluster(cfg)` (its worker calls recorded), with `background_moments=
    cfg.reshard.background_moments` (the runtime's call): the ops it waited for on the
    critical path and those it started in the background."""
    from dynaresize.cluster import resize_ops
    from dynaresize.cluster.cluster import Cluster, ResizeOutcome
    from dynaresize.control import planner
    from dynaresize.types import Assignment

    class Worker:
        def __getattr__(self, method: str) -> Any:
            return SimpleNamespace(remote=lambda *a, **kw: method)

    cluster = Cluster(cfg)
    cluster.stop()
    cluster.workers = [Worker() for _ in range(cfg.cluster.devices)]
    cluster.wait = lambda calls, where, deadline_s=None: [{"t0": 0.0, "t1": 1.0} for _ in calls]
    plan = planner.plan_resize(resize_id=0, step=1, src=Assignment.split(cfg.cluster.devices, 2), target_rollout=1)
    ctx = resize_ops.ResizeContext(cluster=cluster, plan=plan, version=1, step=1,
                                   background_moments=cfg.reshard.background_moments,
                                   out=ResizeOutcome(plan=plan, t_decide=0.0))
    resize_ops.HANDLERS[planner.RECEIVE_OPTIMIZER_SHARDS](ctx)
    return ([(o["name"], o["device"], o["critical"]) for o in ctx.out.ops],
            [(name, d) for name, d, _ in ctx.out.background])


def _paced_wall_s(cfg: RunConfig) -> tuple:
    """Wall seconds the driver paces a training call and a weight sync to (cluster/pacing.py)."""
    from dynaresize.cluster.pacing import DriverPacing

    pacing = DriverPacing(cfg)
    if not pacing.on:
        return None
    return round(pacing.train_s(0, 2) / pacing.time_scale, 9), round(pacing.sync_s() / pacing.time_scale, 9)


def _job(cfg: RunConfig) -> Any:
    from dynaresize.driver.job import Job

    return Job(cfg)


FILTER_ON = {"algorithm": {"filter_groups": True}}
OVERLONG = {"reward": {"overlong_buffer_len": 127}}  # the default budget is 128: penalised from 1 token


def _dynamic_sampling(cfg: RunConfig) -> Any:
    """Step 0 through the driver's dynamic sampling on fixed texts by prompt (tests/unit/_dapo_fake.py),
    or `Job.score` as the run does with filtering off: the consumed ids, advantages, the ledger's
    drops and the step's filter fields; or the error it stops with."""
    from _dapo_fake import scored_with_filter

    return scored_with_filter(cfg)


# A multi-turn task small enough to run in a probe: one prompt group of the guessing game.
AGENT = {"task": {"name": "agent-guess"},
         "rollout": {"synthetic_lengths": False, "max_new_tokens": 8, "prompts_per_step": 1, "max_prompt_tokens": 16}}


def _trajectories(cfg: RunConfig) -> tuple:
    """Step 0's first prompt group through the worker's turn loop (`make_turn_loop`) around
    the configured engine with the initial weights: each result's turns, stop reason, tokens
    and environment error; and the loop's environment deadline."""
    from dynaresize.cluster.worker_serve import make_turn_loop
    from dynaresize.driver.job import Job
    from dynaresize.rl.env import env_spec
    from dynaresize.rl.models import build_model
    from dynaresize.roles.factory import rollout_engine_from_config
    from dynaresize.roles.multiturn import TurnEngine

    reqs = Job(cfg).requests(0)[0]
    with mock.patch("dynaresize.roles.base.resolve_engine", return_value="hf"):
        engine = rollout_engine_from_config(cfg)
    engine.set_weights(build_model(cfg.model).state_dict(), 0)
    spec = env_spec(cfg.task)
    loop = make_turn_loop(cfg, spec) if spec else None
    out = (loop or engine) and (TurnEngine(engine, loop) if loop else engine).generate(reqs)
    return ([(r.turns, r.stop_reason, len(r.response_ids), r.env_error) for r in out],
            loop.timeout_s if loop else None)


# ---------------------------------------------------------------- the table

OTHER_BACKEND = "gloo" if torch.cuda.is_available() else "nccl"  # the one `auto` does not pick here

EVIDENCE: dict[str, tuple] = {
    "steps": (Probe(10, _train_steps, base={"train": {"lr_schedule": "linear"}}),),
    "seed": (Probe(7, _requests),),
    "deterministic": (Probe(True, _sharded),
                      Runtime("tests/e2e/test_run.py::test_deterministic_run_with_resizes_equals_static_run",
                              "with deterministic=true a run with resizes equals the static run (tokens, weights)")),
    "faults": (Probe(["kill:1@train:2"], _faults),
               Runtime("tests/e2e/test_faults.py::"
                       "test_trainer_killed_mid_step_recovers_and_equals_the_uninterrupted_run",
                       "the configured fault fires: one fault record with that kind, point and device, then recovery")),
    "cluster.devices": (Probe(6, _decisions),),
    "cluster.rollout_devices": (Probe(1, _decisions),),
    "cluster.address": (Probe("ray://10.0.0.1:10001", _cluster_start),),
    "cluster.backend": (Probe(OTHER_BACKEND, _cluster_start),),
    "cluster.cpus_per_device": (Probe(2.0, _cluster_start),),
    "cluster.torch_threads": (Probe(2, _cluster_start),),
    "cluster.placement_strategy": (Probe("SPREAD", _cluster_start),
                                   Refused("spread", "cluster.placement_strategy='spread'"),
                                   Runtime("tests/e2e/test_multinode.py::test_node_lost_mid_run_recovers_on_the_survivors",
                                           "with placement_strategy=SPREAD the run's devices are on both nodes of a "
                                           "2-node cluster")),
    "cluster.emulate": (Probe("h200:7b", _paced_wall_s, base={"cluster": {"rollout_devices": 2}}),
                        Refused("tpu:7b", "cluster.emulate='tpu:7b'"),
                        Runtime("tests/dist/test_emulate_run.py::test_stages_last_their_modelled_time_unless_flagged",
                                "each rollout and training call of an emulated run lasts its modelled time")),
    "cluster.time_scale": (Probe(30.0, _paced_wall_s, base={"cluster": {"emulate": "h200:7b", "rollout_devices": 2}}),
                           Refused(0, "cluster.time_scale=0", base={"cluster": {"emulate": "h200:7b", "rollout_devices": 2}})),
    "model.path": (Probe(HF_DIR, _model),),
    "model.hidden_size": (Probe(64, _model),),
    "model.num_layers": (Probe(2, _model),),
    "model.num_heads": (Probe(4, _model),),
    "model.num_kv_heads": (Probe(2, _model),),
    "model.tie_word_embeddings": (Probe(False, _model),),
    "model.vocab_size": (Probe(700, _model),),
    "model.init_seed": (Probe(3, _model),),
    "task.name": (Probe("toy-count:bk", _requests),),
    "task.prompts_file": (Probe(PROMPTS_FILE, _requests,
                                base={"task": {"reward": "dynaresize.rl.tasks:toy_count_reward"}}),),
    "task.dataset": (Probe(VERL_PARQUET, _requests, base={"task": {"reward": VERL_REWARD}}),
                     Refused(VERL_PARQUET, "task.name='toy-count:bk': unused with task.dataset",
                             base={"task": {"name": "toy-count:bk", "reward": VERL_REWARD}})),
    "task.columns": (Probe({"prompt": "question"}, _requests,
                           base={"task": {"dataset": QA_FILE, "reward": LENGTH_REWARD}}),
                     Refused("answer=solution", "task.columns={'answer': 'solution'}: 'answer' is not a role",
                             base={"task": {"dataset": QA_FILE, "reward": LENGTH_REWARD}})),
    "task.reward_style": (Probe("verl", _scores, base={"task": {"reward": ANY_STYLE_REWARD}}),
                          Refused("keras", "task.reward_style='keras': must be auto, dynaresize, verl, trl"),
                          Runtime("tests/e2e/test_user_job.py::test_trl_jsonl_and_reward_function_run_unchanged",
                                  "auto detects a TRL function from its signature and the run says so")),
    "task.reward_workers": (Probe(2, _reward_workers),
                            Refused(0, "task.reward_workers=0: must be >= 1"),
                            Runtime("tests/unit/test_reward_pool.py::"
                                    "test_the_pool_kills_and_replaces_a_hung_worker_and_reports_each_fate",
                                    "two workers score two 1 s calls in about 1 s, in two processes")),
    "task.reward_timeout_s": (Probe(0.2, _scores, base={"task": {"reward": NAP_REWARD, "on_reward_error": "zero"}}),
                              Refused(0, "task.reward_timeout_s=0.0: must be > 0"),
                              Runtime("tests/e2e/test_user_job.py::"
                                      "test_a_reward_that_raises_or_hangs_follows_on_reward_error",
                                      "a hung reward times out after the deadline, scored 0 with the sample id")),
    "task.reward": (Probe(LENGTH_REWARD, _scores),),
    "task.on_reward_error": (Probe("zero", _scores, base={"task": {"reward": BROKEN_REWARD}}),),
    "task.env": (Probe("dynaresize.rl.agent_task:CalculatorEnv", _trajectories, base=AGENT | {"task": {}}),
                 Refused("nowhere_at_all:Env", "task.env 'nowhere_at_all:Env': module 'nowhere_at_all' not found",
                         via=_job, base=AGENT | {"task": {}}),
                 Runtime("tests/e2e/test_agent_run.py::test_a_multi_turn_run_with_resizes_equals_a_static_run",
                         "the calculator environment's trajectories run 1-3 turns on the real runtime")),
    "task.max_turns": (Probe(1, _trajectories, base=AGENT),
                       Refused(2, "task.max_turns=2: only read by a multi-turn task")),
    "task.max_total_tokens": (Probe(24, _trajectories, base=AGENT),
                              Refused(64, "task.max_total_tokens=64: only read by a multi-turn task"),
                              Refused(16, "rollout.max_prompt_tokens=16: leaves no room for a turn within "
                                          "task.max_total_tokens=16", via=_job, base=AGENT)),
    "task.env_timeout_s": (Probe(0.5, _trajectories, base=AGENT),
                           Refused(0, "task.env_timeout_s=0.0: must be > 0"),
                           Runtime("tests/unit/test_multiturn.py::"
                                   "test_an_environment_that_fails_ends_its_trajectory_with_the_reason",
                                   "an environment call past the deadline ends its trajectory with 'timed out after'")),
    "task.chat_template": (Probe(True, _requests, base={"model": {"path": HF_DIR}}),
                           Refused(True, "task.chat_template=True", via=_job),
                           Runtime("tests/e2e/test_user_model.py::"
                                   "test_prompts_use_the_folder_chat_template_and_are_truncated",
                                   "with a user folder the prompt ids open with its user turn and end with the "
                                   "assistant turn")),
    "rollout.engine": ((Probe("hf", _engine_class, base={**VLLM_MODEL, "rollout": {"engine": "vllm"}}),) if HAVE_VLLM
                       else (Refused("vllm", "rollout.engine='vllm': the vllm package is not installed"),))
                      + (Refused("sglang", "rollout.engine='sglang': must be one of"),),
    "rollout.engine_release": (Probe("teardown", _release_engine),),
    "rollout.tensor_parallel": (Probe(2, lambda cfg: run_bounds(cfg).move_unit),
                                Refused(0, "rollout.tensor_parallel=0"),
                                Refused(2, "rollout.tensor_parallel=2: must be 1 with a multi-turn task",
                                        via=worker_config,
                                        base=AGENT | {"rollout": {**AGENT["rollout"], "engine": "vllm"}}),
                                Refused(2, "rollout.tensor_parallel=2: needs the vllm engine", via=worker_config,
                                        base={"rollout": {"engine": "hf"}}),
                                Refused(2, "rollout.tensor_parallel=2: emulated runs pace TP1 engines", via=run_bounds,
                                        base={"cluster": {"emulate": "h200:7b", "rollout_devices": 2}}),
                                Runtime("tests/e2e/test_tp_replicas.py::"
                                        "test_a_tp2_replica_moves_each_way_whole_and_the_run_equals_the_static_one",
                                        "a TP2 replica (two vLLM ranks) moves each way whole; the run equals a "
                                        "static one")),
    "rollout.partial": (Runtime("tests/e2e/test_staleness_run.py::test_partial_rollout_run_records_token_versions_within_the_bound",
                                "samples span two weight versions, each recorded, the oldest within the bound"),
                        Runtime("tests/unit/test_worker_serve.py::test_weight_change_under_running_requests_needs_partial_rollout",
                                "without it a weight change under running requests is refused"),
                        Refused(True, "rollout.partial=True: needs train.staleness >= 2"),
                        Refused(True, "rollout.partial=True: needs train.staleness >= 2",
                                base={"deterministic": True, "train": {"staleness": 2}})),
    "rollout.vllm_max_num_seqs": (Probe(5, _vllm_kwargs, base=VLLM_MODEL),),
    "rollout.vllm_max_model_len": (Probe(300, _vllm_kwargs, base=VLLM_MODEL),),
    "rollout.vllm_kv_cache_bytes": (Probe(3 << 20, _vllm_kwargs, base=VLLM_MODEL),),
    "rollout.gpu_memory_utilization": (Probe(0.5, _vllm_kwargs_on_cuda, base=VLLM_MODEL),
                                       Refused(0, "rollout.gpu_memory_utilization=0.0: must be in (0, 1]"),
                                       Refused(1.5, "rollout.gpu_memory_utilization=1.5: must be in (0, 1]")),
    "rollout.prompts_per_step": (Probe(3, _requests),),
    "rollout.samples_per_prompt": (Probe(2, _requests), Probe(2, _scores)),
    "rollout.max_new_tokens": (Probe(64, _requests),
                               Refused(4000, "rollout.max_new_tokens=4000 exceeds", via=_job)),
    "rollout.temperature": (Probe(0.5, _generated),),
    "rollout.synthetic_lengths": (Probe(False, _requests),),
    "rollout.length_workload": (Probe("longtail-drift", _requests),),
    "rollout.length_horizon_steps": (Probe(10, _lengths_later),
                                     Refused(-1, "rollout.length_horizon_steps=-1")),
    "rollout.batch_rows": (Probe(8, _generated),),
    "rollout.dtype": (Probe("bf16", _vllm_kwargs, base=VLLM_MODEL), Probe("bf16", _generated),
                      Refused("bf16", "rollout.dtype='bf16': deterministic mode needs fp32",
                              base={"deterministic": True}),
                      Refused("fp16", "rollout.dtype='fp16': must be one of auto, fp32, bf16")),
    "rollout.weight_sync": (Probe("delta", _sync_mode), Probe("full", _sync_mode, base={"rollout": {"dtype": "bf16"}}),
                            Runtime("tests/e2e/test_delta_sync_run.py::test_bf16_delta_sync_run_with_moves",
                                    "delta syncs after the first send <= 10% of the full bytes, engines equal the "
                                    "trainers' bf16 cast (digest), tokens equal the full-sync run's"),
                            Refused("sparse", "rollout.weight_sync='sparse': must be one of auto, full, delta")),
    "rollout.max_prompt_tokens": (Probe(8, _requests),
                                  Refused(4000, "rollout.max_prompt_tokens=4000", via=_job)),
    "train.lr": (Probe(1e-2, _train_steps),),
    "train.weight_decay": (Probe(0.5, _train_steps),),
    "train.betas": (Probe([0.5, 0.9], _train_steps),),
    "train.eps": (Probe(1.0, _train_steps),),
    "train.clip_eps": (Probe(5.0, _train_steps), Probe(0.1, _loss_terms),
                       Refused(0.1, "train.clip_eps=0.1: unused when clip_ratio_low and clip_ratio_high",
                               base={"train": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}})),
    "train.kl_coef": (Probe(0.1, _train_steps),
                      Runtime("tests/e2e/test_run.py::test_bf16_with_kl_schedule_and_clipping_through_resizes",
                              "with kl_coef=0.05 the recorded KL is 0 at step 0 and > 0 after")),
    "train.micro_batch_size": (Probe(1, _train_steps),),
    "train.staleness": (Probe(0, _staleness), Probe(2, _staleness), Refused(5, "train.staleness=5"),
                        Runtime("tests/e2e/test_faults.py::test_streaming_fault_matrix",
                                "with staleness=2 a lost trainer is recovered in-run and the run equals the uninterrupted one"),
                        Runtime("tests/e2e/test_staleness_run.py::test_staleness_2_with_resizes_keeps_the_ledger_and_the_bound",
                                "with staleness=2 every sample's version is max(0, consumed_step - 2), the bound reached")),
    "train.dtype": (Probe("bf16", _sharded), Probe("bf16", _behaviour_logprobs)),
    "train.activation_checkpointing": (Probe(True, _sharded),),
    "train.logprob_chunk_tokens": (Probe(0, _head_outputs), Refused(-1, "train.logprob_chunk_tokens=-1")),
    "train.kl_estimator": (Probe("k1", _train_steps, base={"train": {"kl_coef": 0.1}}),),
    "train.lr_schedule": (Probe("cosine", _train_steps),
                          Runtime("tests/e2e/test_run.py::test_bf16_with_kl_schedule_and_clipping_through_resizes",
                                  "with lr_schedule=cosine the recorded lr decays step by step after the warmup")),
    "train.warmup_steps": (Probe(3, _train_steps),
                           Runtime("tests/e2e/test_run.py::test_bf16_with_kl_schedule_and_clipping_through_resizes",
                                   "with warmup_steps=2 the recorded lr rises over steps 0-1, then decays")),
    "train.min_lr_ratio": (Probe(0.5, _train_steps, base={"train": {"lr_schedule": "linear"}}),),
    "train.max_grad_norm": (Probe(0.01, _train_steps),),
    "train.old_logprobs": (Probe("recompute", _behaviour_logprobs),),
    "train.clip_ratio_low": (Probe(0.5, _train_steps), Refused(0, "train.clip_ratio_low=0")),
    "train.clip_ratio_high": (Probe(0.28, _loss_terms), Refused(-0.1, "train.clip_ratio_high=-0.1"),
                              Runtime("tests/e2e/test_loss_variants_run.py::"
                                      "test_loss_variants_deterministic_run_with_resizes_equals_static_run",
                                      "with clip_ratio_high=0.28 (and the other loss variants) a run with resizes "
                                      "equals the static run")),
    "train.clip_ratio_c": (Probe(3.0, _loss_terms), Refused(1.0, "train.clip_ratio_c=1.0: must be > 1")),
    "train.loss_agg_mode": (Probe("seq-mean-token-sum", _train_steps), Probe("seq-mean-token-mean", _train_steps),
                            Probe("seq-mean-token-sum-norm", _train_steps),
                            Refused("seq-mean", "train.loss_agg_mode='seq-mean': must be one of")),
    "train.norm_adv_by_std": (Probe(False, _scores),
                              Refused(False, "train.norm_adv_by_std=False: only grpo divides by the group std",
                                      base={"algorithm": {"adv_estimator": "reinforce_plus_plus"}}),
                              Refused(True, "rollout.samples_per_prompt=1: must be >= 2",
                                      base={"rollout": {"samples_per_prompt": 1}})),
    "train.adv_std": (Probe("population", _scores), Refused("biased", "train.adv_std='biased'"),
                      Refused("population", "train.adv_std='population': only grpo divides by the group std",
                              base={"algorithm": {"adv_estimator": "rloo"}})),
    "algorithm.filter_groups": (Probe(True, _dynamic_sampling),
                                Runtime("tests/e2e/test_dapo.py::"
                                        "test_deterministic_run_with_filtering_and_moves_equals_the_static_run",
                                        "with filtering on, one-step off and at staleness 2, a deterministic run "
                                        "with moves each way has steps of 2+ generation batches and equals the "
                                        "static run (every sample's fate and tokens, parameters within 1e-6)"),
                                Refused(True, "algorithm.filter_groups=True: not with cluster.emulate and "
                                        "train.staleness >= 2", base={"cluster": {"emulate": "a100:7b", "rollout_devices": 2},
                                                                      "train": {"staleness": 2}}),
                                Runtime("tests/e2e/test_dapo.py::test_dapo_preset_filters_groups_and_moves_each_way",
                                        "the dapo preset's run has steps of 2+ generation batches, filtered samples "
                                        "in the ledger, ledger ok, a move each way")),
    "algorithm.filter_metric": (Probe("score", _dynamic_sampling, base=merge(FILTER_ON, OVERLONG)),
                                Refused(" ", "algorithm.filter_metric=' ': must name a metric"),
                                Refused("reward", "algorithm.filter_metric='reward': with cluster.emulate only `workload`",
                                        base=merge(FILTER_ON, {"cluster": {"emulate": "a100:7b", "rollout_devices": 2}})),
                                Refused("workload", "algorithm.filter_metric='workload': needs rollout.synthetic_lengths",
                                        base=FILTER_ON),
                                Runtime("tests/dist/test_emulate_dapo_filter_run.py::"
                                        "test_the_runtime_generates_the_simulators_generation_batches",
                                        "with `workload`, an emulated run's steps take the simulator's generation "
                                        "batches and filter its groups (ledger reason), paced as it predicts"),
                                Refused("acc", "algorithm.filter_metric='acc': only used with")),
    "algorithm.max_num_gen_batches": (Probe(2, _dynamic_sampling, base=FILTER_ON),
                                      Refused(-1, "algorithm.max_num_gen_batches=-1"),
                                      Refused(3, "algorithm.max_num_gen_batches=3: only used with")),
    "rollout.gen_prompts_per_step": (Probe(3, _requests, base=FILTER_ON), Probe(3, _dynamic_sampling, base=FILTER_ON),
                                     Refused(3, "rollout.gen_prompts_per_step=3: only used with"),
                                     Refused(-1, "rollout.gen_prompts_per_step=-1")),
    "reward.overlong_buffer_len": (Probe(127, _scores), Probe(127, _dynamic_sampling, base=FILTER_ON),
                                   Refused(200, "reward.overlong_buffer_len=200: must be <= rollout.max_new_tokens"),
                                   Refused(8, "reward.overlong_buffer_len=8: not with a multi-turn task", via=_job,
                                           base=AGENT)),
    "reward.overlong_penalty_factor": (Probe(0.5, _scores, base=OVERLONG),
                                       Refused(2.0, "reward.overlong_penalty_factor=2.0: only used with"),
                                       Refused(-1.0, "reward.overlong_penalty_factor=-1.0")),
    "algorithm.adv_estimator": (Probe("rloo", _scores), Probe("reinforce_plus_plus", _scores),
                                Probe("reinforce_plus_plus_baseline", _scores),
                                Refused("gae", "algorithm.adv_estimator='gae': must be one of")),
    "train.entropy_coef": (Probe(0.01, _train_steps), Refused(-0.1, "train.entropy_coef=-0.1")),
    "train.kl_penalty": (Refused("reward", "train.kl_penalty='reward': not supported"),
                         Refused("sum", "train.kl_penalty='sum': must be loss")),
    "train.lora.rank": (Probe(4, _lora_forward, base=LORA_BASE), Refused(0, "train.lora.rank=0: must be an integer >= 1"),
                        Refused(2, "rollout.weight_sync='delta': not with train.lora",
                                base={"rollout": {"weight_sync": "delta"}}),
                        Runtime(LORA_RUN, "with rank 4 a run with a move each way equals its static run; each "
                                "resize's op bytes are the adapter's and its moments' (within 10%), each sync's "
                                "wire_bytes the adapter's")),
    "train.lora.alpha": (Probe(32.0, _lora_forward, base=LORA_BASE),
                         Refused(0.0, "train.lora.alpha=0.0: must be > 0", base=LORA_BASE)),
    "train.lora.dropout": (Probe(0.5, _lora_forward, base=LORA_BASE),
                           Refused(1.0, "train.lora.dropout=1.0: must be in [0, 1)", base=LORA_BASE)),
    "train.lora.target_modules": (Probe(("q_proj", "v_proj"), _lora_forward, base=LORA_BASE),
                                  Refused(("all-linear", "q_proj"), "train.lora.target_modules='all-linear,q_proj'",
                                          base=LORA_BASE)),
    "policy.name": (Probe("greedy", _decisions, base=POLICY_BASE),),
    "policy.static_rollout": (Probe(4, _decisions, base=merge(POLICY_BASE, {"policy": {"name": "static"}})),),
    "policy.schedule": (Probe("3:4,9:1", _decisions,
                              base=merge(POLICY_BASE, {"policy": {"name": "scripted", "schedule": "5:3"}})),),
    "policy.min_rollout": (Probe(2, _decisions, base=POLICY_BASE),),
    "policy.min_train": (Probe(3, _decisions, base=POLICY_BASE),),
    "policy.move_unit": (Probe(2, _decisions, base=POLICY_BASE),),
    "policy.profile_steps": (Probe(6, _decisions, base=POLICY_BASE),),
    "policy.enter_band": (Probe(0.3, _decisions, base=POLICY_BASE),),
    "policy.exit_band": (Probe(0.0, _decisions, base=POLICY_BASE),),
    "policy.dwell_steps": (Probe(4, _decisions, base=POLICY_BASE),),
    "policy.cooldown_steps": (Probe(6, _decisions, base=POLICY_BASE),),
    "policy.horizon_steps": (Probe(2, _decisions, base=POLICY_BASE),),
    "policy.cost_margin": (Probe(20.0, _decisions, base=POLICY_BASE),),
    "policy.greedy_threshold": (Probe(3.0, _decisions, base=merge(POLICY_BASE, {"policy": {"name": "greedy"}})),),
    "policy.move_cost_prior_s": (Probe(100.0, _decisions, base=POLICY_BASE),),
    "policy.allowed_rollout": (Probe((2, 4), _decisions, base=POLICY_BASE),
                               Refused((4, 2), "policy.allowed_rollout")),
    "reshard.staging_bytes": (Probe(4096, _reshard),
                              Runtime("tests/dist/test_bench_resize.py::test_bench_resize_end_to_end",
                                      "for each configured bound the resizes' peak staging stays within it")),
    "reshard.background_moments": (Probe(False, _moments),),
    "timeouts.collective_s": (Probe(1000.0, _watchdog),),
    "timeouts.actor_call_s": (Probe(2000.0, _watchdog),),
    "checkpoint.every_steps": (Probe(5, _checkpoints),),
    "checkpoint.snapshot_every_steps": (Probe(3, _snapshot_kinds), Probe(3, _young_daly),
                                        Refused(-1, "checkpoint.snapshot_every_steps=-1"),
                                        Runtime("tests/e2e/test_snapshots.py::test_full_snapshots_every_k_steps",
                                                "with 3 a 10-step run's snapshot records are full at versions "
                                                "3, 6, 9 and 10 (the final checkpoint) and params-only between")),
    "checkpoint.mtbf_s": (Probe(100.0, _young_daly), Refused(0.0, "checkpoint.mtbf_s=0.0")),
    "checkpoint.dir": (Probe(CHECKPOINT_DIR, _checkpoint_root),
                       Runtime("tests/e2e/test_multinode.py::test_node_lost_mid_run_recovers_on_the_survivors",
                               "with checkpoint.dir set the run's checkpoints and latest.json are there and not in "
                               "RUN_DIR/checkpoint")),
    "eval.every_steps": (Probe(2, _eval), Refused(-1, "eval.every_steps=-1"),
                         Runtime("tests/e2e/test_eval.py::test_eval_records_at_their_steps_and_training_unchanged",
                                 "with every_steps=2 a 4-step run has eval records after steps 1 and 3")),
    "eval.prompts_file": (Probe(PROMPTS_FILE, _eval, base=EVAL_BASE),),
    "eval.num_prompts": (Probe(3, _eval, base=EVAL_BASE),),
    "eval.samples_per_prompt": (Probe(2, _eval, base=EVAL_BASE),),
    "eval.correct_threshold": (Probe(0.2, _eval, base=EVAL_BASE),),
    "logging.backends": (Probe(["jsonl", "tensorboard"], _sinks),
                         Runtime("tests/e2e/test_lab_tooling.py::"
                                 "test_tensorboard_reader_finds_every_scalar_of_the_run",
                                 "with logging.backends=tensorboard,... TensorBoard's reader finds every scalar")),
}

# Fields neither probed, refused nor checked by a runtime test: path -> why. Pinned below.
UNPROVEN: dict[str, str] = {}
EXPECTED_UNPROVEN: frozenset[str] = frozenset()


def _cases(kind: type) -> list:
    return [pytest.param(path, i, ev, id=f"{path}#{i}")
            for path, evs in EVIDENCE.items() for i, ev in enumerate(evs) if isinstance(ev, kind)]


# ---------------------------------------------------------------- the tests


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """The workers' math runs on one thread (`cluster.torch_threads`); so do the probes."""


def test_every_field_has_evidence():
    paths = list(_paths(RunConfig))
    missing = [p for p in paths if p not in EVIDENCE and p not in UNPROVEN]
    assert not missing, f"config fields with no evidence that they change behaviour (add an entry): {missing}"
    stale = sorted(set(EVIDENCE) - set(paths))
    assert not stale, f"evidence for fields RunConfig no longer has: {stale}"
    for path in paths:
        kinds = {type(ev) for ev in EVIDENCE.get(path, ())}
        assert kinds & {Probe, Refused} or path in UNPROVEN, (
            f"{path}: a runtime test alone is not checked here; add a probe or a refusal, or list it in UNPROVEN")


def test_unproven_is_exactly_known():
    assert set(UNPROVEN) == EXPECTED_UNPROVEN
    assert not set(UNPROVEN) & set(EVIDENCE)
    assert all(reason.strip() for reason in UNPROVEN.values())


_DEFAULT_SEEN: dict = {}


def _default_observation(ev: Probe) -> Any:
    """The probe on the default config (with `base`), computed twice the first time: a probe
    that is not reproducible could show a difference that is not the field's."""
    key = (ev.fn, json.dumps(_resolve(ev.base), sort_keys=True, default=str))
    if key not in _DEFAULT_SEEN:
        first = ev.fn(build_config(_data(ev.base)))
        assert ev.fn(build_config(_data(ev.base))) == first, f"the probe {ev.fn.__name__} is not reproducible"
        _DEFAULT_SEEN[key] = first
    return _DEFAULT_SEEN[key]


@pytest.mark.parametrize("path, index, ev", _cases(Probe))
def test_field_changes_behaviour(path, index, ev):
    default = build_config(_data(ev.base))
    alternative = build_config(_data(ev.base, _nested(path, ev.alt)))
    assert _get(alternative, path) != _get(default, path), f"{path}: the alternative is the default value"
    assert ev.fn(alternative) != _default_observation(ev), (
        f"{path}={_get(alternative, path)!r} is accepted but {ev.fn.__name__} sees no change from "
        f"{_get(default, path)!r}: accepted-but-ignored?")


@pytest.mark.parametrize("path, index, ev", _cases(Refused))
def test_field_value_is_refused(path, index, ev):
    data = _data(ev.base, _nested(path, ev.value))
    with pytest.raises(UserError) as info:
        cfg = build_config(data)
        if ev.via is None:
            pytest.fail(f"{path}={ev.value!r}: build_config accepted it")
        ev.via(cfg)
    message = str(info.value)
    assert ev.fragment in message, message
    assert "\n" not in message and "Traceback" not in message


def _test_functions(relpath: str) -> dict[str, set[str]]:
    """Each test function of a file, with the marks on it and on its module (`pytestmark`)."""
    tree = ast.parse((ROOT / relpath).read_text())
    module_marks = {m for node in tree.body if isinstance(node, ast.Assign)
                    and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
                    for m in _mark_names(node.value)}
    return {n.name: module_marks | {m for d in n.decorator_list for m in _mark_names(d)}
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_")}


def _mark_names(node: ast.AST) -> set[str]:
    """`pytest.mark.NAME` anywhere in a decorator or a pytestmark value."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


# What CI runs (.ci/run): `make test` (the default suite) and `make test-slow` (every slow test).
# A test CI never runs (a GPU test, a skipped one) is no evidence.
NOT_RUN_BY_CI = {"gpu", "skip", "skipif"}


@pytest.mark.parametrize("path, index, ev", _cases(Runtime))
def test_runtime_evidence_exists(path, index, ev):
    relpath, _, name = ev.test.partition("::")
    assert (ROOT / relpath).is_file(), ev.test
    functions = _test_functions(relpath)
    assert name in functions, f"{path}: {ev.test} does not exist"
    assert not relpath.startswith("tests/gpu/") and not functions[name] & NOT_RUN_BY_CI, (
        f"{path}: {ev.test} is marked {sorted(functions[name] & NOT_RUN_BY_CI)}: CI never runs it")
    assert ev.asserts.strip()


def test_ci_runs_the_suites_the_evidence_names():
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert "make test" in commands and "make test-slow" in commands, commands


@pytest.mark.parametrize("staleness", [1, 2])
def test_the_runtimes_hysteresis_models_its_own_pipeline(staleness):
    """train.staleness >= 2: the runtime's hysteresis fits the streaming throughput model (a
    step's rollout latency is no stage time there); 0 and 1 keep the one-step-off model."""
    from dynaresize.driver.run import Run
    from dynaresize.policy.model import OnlineStageModel
    from dynaresize.policy.stream_model import StreamStageModel

    run = Run.__new__(Run)
    run.cfg = build_config(merge(preset("cpu"), {"train": {"staleness": staleness}, "policy": {"name": "hysteresis"}}))
    ctl, _ = run._controller({})
    want = StreamStageModel if staleness >= 2 else OnlineStageModel
    assert isinstance(ctl.policy.model, want) and ctl.policy.stream == (staleness >= 2)
