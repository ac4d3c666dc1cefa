"""Response-length workloads: a hierarchical lognormal with per-prompt effects, drift over
steps, a runaway-to-cap component and truncation (docs/references.md 7.1 and 7.2;
bare section numbers below point there too).

For step t, prompt p and sample j:

    a_p     ~ N(0, sigma_p^2)                    prompt difficulty (Seer, RhymeRL: samples of
                                                 one prompt have similar lengths)
    e_pj    ~ N(0, sigma_r^2)                    intra-prompt spread (DARTS)
    L*      = exp(mu(t) + a_p + e_pj)
    L*      = cap(t) with probability pi(t)      runaway / repetition ends at the cap
    L       = clip(ceil(L*), 1, cap(t))          truncation (verl's clip_ratio)

    mu(t)   = mu0 + drift * (1 - exp(-t / tau)) - dip * exp(-t / tau_dip) + eta_t,
    eta_t   ~ N(0, jitter^2),   pi(t) = min(pi_max, pi0 * exp(kappa * (mu(t) - mu0)))

Every workload is defined in a reference domain whose final cap is `cap_tokens` (16k tokens,
the RollPacker / DeepScaleR setting); `sample_lengths` rescales it so that the cap is
`max_tokens` (the simulator passes `cap_tokens`; the real CPU runtime passes 32-64 so a tiny
model sees the same shape).

Time is the ABSOLUTE step. Each workload has its own horizon (`horizon_steps`, 300 for the
simulator's workloads, 30 for `demo`); its time constants (tau, the cap-raise step, the U of
`demo`) are fractions of that horizon, never of the run's length. So a run's lengths do not
depend on how many steps it was started for: a 40-step run sees the first 40 steps of the
300-step run, and a resume with more steps continues the same job. Past its horizon a workload
keeps its last regime (the drift saturates, the cap stays raised, the U stays at its end level).

Invariants: pure (numpy only, no clock, no I/O); a length depends only on (workload, step,
prompt index, sample index, seed) and on `max_tokens`, never on the run's number of steps,
device counts, or how many prompts or samples the step has (random numbers are a
counter-based hash of the sample id, not a stream).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from dynaresize.errors import ConfigError

_MASK = (1 << 64) - 1
_STREAM_PROMPT, _STREAM_SAMPLE, _STREAM_RUNAWAY, _STREAM_STEP = 1, 2, 3, 4


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """Parameters of one named workload (reference domain: final cap `cap_tokens`)."""

    name: str
    cap_tokens: int = 16384
    mu0: float = math.log(700.0)  # log median length at step 0 (RollPacker P75 ~900: 7.1)
    sigma: float = 1.0  # total log-sd; 1.0-1.2 matches RollPacker / Seer (7.1)
    prompt_share: float = 0.75  # sigma_p = prompt_share * sigma (7.1 default)
    drift: float = 0.0  # total log growth of the median (7.2: ln 2 over ~200 steps)
    horizon_steps: int = 300  # the absolute step span the time constants below are fractions of
    tau_frac: float = 2.0 / 3.0  # drift time constant as a fraction of horizon_steps
    dip: float = 0.0  # early shortening (DeepScaleR 5.5k -> 3.5k: 0.45)
    dip_tau_frac: float = 0.15
    u_rise: float = 0.0  # `demo`: log depth of a U (falls to mid-run, then rises)
    u_end: float = 0.0  # `demo`: log level at the end relative to the start
    u_power: float = 1.0  # `demo`: > 1 narrows the valley of the U and widens its shoulders
    jitter: float = 0.05  # per-step log jitter (7.2)
    runaway0: float = 0.003  # runaway-to-cap probability at mu0 (7.1: 0-0.5%, long-CoT ~1%)
    runaway_gain: float = 1.0  # kappa: runaway grows as the median grows
    runaway_max: float = 0.05
    cap_schedule: tuple[tuple[float, float], ...] = ((0.0, 1.0),)  # (fraction of horizon, cap fraction)
    prompt_tokens: int = 512  # prompt length in the reference domain (sim only)
    prompts_per_step: int = 0  # the job's batch in prompts, where the workload names one; 0: 2 per device
    # Multi-turn (agentic) workloads (`multi_turn`): a trajectory has 1..max_turns model turns
    # (after each, it goes on with probability turn_continue), the sampled length is its model
    # tokens over all turns, each observation adds obs_tokens, and each environment call between
    # two turns holds the trajectory's slot for a tool latency drawn lognormal around tool_latency_s.
    max_turns: int = 1
    turn_continue: float = 0.0
    obs_tokens: int = 0
    tool_latency_s: float = 0.0
    tool_latency_sigma: float = 1.0
    # Dynamic sampling (DAPO's group filtering, `workload.batch_for_step`): the share of prompt
    # groups whose samples all get the same reward, filter_share0 at step 0 rising to
    # filter_share_end with the drift's time constant (the model solves more prompts); the step
    # generates batches of prompts_per_step prompts until that many groups are kept. 0: off.
    filter_share0: float = 0.0
    filter_share_end: float = 0.0
    max_gen_batches: int = 10  # verl's max_num_gen_batches (the recipe's 10)
    # The filtered share measured by a run, per absolute step (`workload.filter_runs`: its step
    # records' groups_filtered over the groups it scored); past its last step, the last one.
    # Empty: the modelled share above.
    filter_shares: tuple[float, ...] = ()

    def log_median(self, step: int) -> float:
        """mu(t) without the per-step jitter, in the reference domain (t: the absolute step)."""
        n = max(int(self.horizon_steps), 1)
        t = float(step)
        mu = self.mu0
        if self.drift:
            mu += self.drift * (1.0 - math.exp(-t / max(self.tau_frac * n, 1e-9)))
        if self.dip:
            mu -= self.dip * (1.0 - math.exp(-t / max(self.dip_tau_frac * n, 1e-9)))
        if self.u_rise or self.u_end:
            x = min(max(t / max(n - 1, 1), 0.0), 1.0)
            mu += -self.u_rise * (4.0 * x * (1.0 - x)) ** self.u_power + self.u_end * x
        return mu

    def filter_share(self, step: int) -> float:
        """The share of prompt groups filtered out at `step` (0 without dynamic sampling): a run's
        measured share (`filter_shares`) where given, else the modelled one."""
        if self.filter_shares:
            return float(self.filter_shares[min(int(step), len(self.filter_shares) - 1)])
        if not (self.filter_share0 or self.filter_share_end):
            return 0.0
        n = max(int(self.horizon_steps), 1)
        rise = 1.0 - math.exp(-float(step) / max(self.tau_frac * n, 1e-9))
        return self.filter_share0 + (self.filter_share_end - self.filter_share0) * rise

    def cap_fraction(self, step: int) -> float:
        frac = self.cap_schedule[0][1]
        for start, value in self.cap_schedule:
            if step >= int(round(start * max(int(self.horizon_steps), 1))):
                frac = value
        return frac

    def runaway_prob(self, mu: float) -> float:
        return min(self.runaway_max, self.runaway0 * math.exp(self.runaway_gain * (mu - self.mu0)))


WORKLOADS: dict[str, WorkloadSpec] = {
    # Heavy tail (sigma 1.0), median doubling-plus over the run (R1-Zero / verl "length changes
    # significantly"); the runaway share grows with the median. The workload the product targets.
    "longtail-drift": WorkloadSpec(name="longtail-drift", mu0=math.log(1400.0), drift=math.log(2.5),
                                   tau_frac=0.5, runaway0=0.004),
    # The same tail at a fixed median: the split the pilot finds stays right.
    "longtail-stationary": WorkloadSpec(name="longtail-stationary", mu0=math.log(1400.0), runaway0=0.004),
    # Narrow lengths far below the cap, no drift, no runaway: rollout is throughput-bound and its
    # balance with training never shifts, so moving cannot pay for itself.
    "short-tail": WorkloadSpec(name="short-tail", mu0=math.log(700.0), sigma=0.35, runaway0=0.0,
                               cap_tokens=16384),
    # DeepScaleR: the cap is raised 8k -> 16k mid-run; the median grows slowly, and the released
    # tail changes the regime at once.
    "cap-raise": WorkloadSpec(name="cap-raise", mu0=math.log(1400.0), drift=math.log(1.6), tau_frac=0.6,
                              runaway0=0.006, cap_schedule=((0.0, 0.5), (0.5, 1.0))),
    # The seed paper's regime (docs/seed-experiment.md): Qwen3-8B DAPO on one 8-GPU node. From verl's
    # recipe `volcengine/verl` recipe/dapo/test_dapo_8b_megatron_fp16.sh [V]: train_prompt_bsz=32 and
    # n_resp_per_prompt=16 (512 samples per step), max_response_length 8192 with a 4096-token overlong
    # buffer (the soft penalty starts at 4k), max_prompt_length 2048, gen_tp=1, 8 GPUs.
    # Where the recipe and the paper are silent [A]: prompts of 256 tokens (DAPO-Math problems plus
    # the answer-format instruction, far below the 2048 cap); a long-CoT length model (references
    # 7.1 profile B: sigma 0.8, runaway ~1%) whose median grows 900 -> 2,500 tokens over the horizon
    # (a growing long-CoT run, 2.3; the overlong buffer holds the median below 4k), tau a third of
    # the 300-step horizon.
    "dapo-qwen3-8b": WorkloadSpec(name="dapo-qwen3-8b", cap_tokens=8192, mu0=math.log(900.0), sigma=0.8,
                                  drift=math.log(2500.0 / 900.0), tau_frac=1.0 / 3.0, runaway0=0.01,
                                  prompt_tokens=256, prompts_per_step=32),
    # DAPO's dynamic sampling on the seed paper's job (issue 33): `dapo-qwen3-8b`'s lengths and
    # batch, and groups whose rewards are all equal filtered out, further batches of 32 prompts
    # generated until 32 groups are kept (verl's recipe: filter_groups with metric acc,
    # max_num_gen_batches 10; gen_batch_size here = the train batch, so every filtered group
    # costs rollout work). The DAPO paper (arXiv 2503.14476) motivates dynamic sampling by the
    # growing number of prompts whose samples are all correct; the numbers below are ours [A],
    # not transcribed: 30% of groups filtered at step 0 (all wrong or all right), rising towards
    # 70% with the drift's time constant (68% at the end of the 300-step horizon).
    "dapo-filter": WorkloadSpec(name="dapo-filter", cap_tokens=8192, mu0=math.log(900.0), sigma=0.8,
                                drift=math.log(2500.0 / 900.0), tau_frac=1.0 / 3.0, runaway0=0.01,
                                prompt_tokens=256, prompts_per_step=32, filter_share0=0.3, filter_share_end=0.7),
    # The emulated demo (preset `demo`, `make demo`): DeepScaleR's cap raise compressed into a 20-step run.
    # The cap is 1/8 of 16k until step 10, so training is the slower stage and a device moves
    # to it; then the full cap releases the tail, rollout becomes the slower stage and the
    # devices move back. Tuned in the simulator so every seed 0-2 moves both ways.
    "demo-cap-raise": WorkloadSpec(name="demo-cap-raise", mu0=math.log(1200.0), runaway0=0.006,
                                   cap_schedule=((0.0, 0.125), (0.5, 1.0)), horizon_steps=20),
    # The CPU demo: the median first falls then rises (DeepScaleR's U, docs/references.md 2.3), so a short
    # real run sees rollout get lighter then heavier and resizes go both ways.
    # No runaway here: a demo's batch is small, and a random cap-length response would hide the U.
    # The U is deep (8x) so that a 4-device CPU run sees rollout-bound, then train-bound, then
    # rollout-bound windows: a demo of the mechanism, not a calibrated workload.
    # Its horizon is the `default`/`cpu` presets' 30 steps (the U was tuned on a 30-step run).
    # An agentic, tool-using job (issue 24; [A] from the shapes of SWE/search agent runs in verl's
    # and SkyRL's examples): up to 8 turns, 70% going on after each (2.9 turns on average), 600-token
    # turns at the median with the usual heavy tail over the whole trajectory, 150-token tool
    # results, and tool calls of ~2 s at the median with a heavy tail (a sandbox or a search API:
    # sigma 1, so 1 call in 20 takes over 10 s). Its tail is made of turns *and* tool waits.
    "agent-tools": WorkloadSpec(name="agent-tools", mu0=math.log(1800.0), sigma=1.0, runaway0=0.002,
                                max_turns=8, turn_continue=0.7, obs_tokens=150, tool_latency_s=2.0,
                                prompt_tokens=1024),
    "demo": WorkloadSpec(name="demo", mu0=math.log(6000.0), sigma=0.4, u_rise=math.log(30.0),
                         u_power=2.0, u_end=math.log(2.5), runaway0=0.0, jitter=0.02, horizon_steps=30),
}


def multi_turn(spec: WorkloadSpec, step: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(turns, tool wait seconds) of the `n` trajectories of step `step` of a multi-turn
    workload: turns in 1..max_turns (geometric by turn_continue), a wait of (turns - 1) tool
    latencies. Seeded by (seed, workload, step) alone."""
    rng = np.random.default_rng([int(seed), _name_id(spec.name), int(step), 7])
    go_on = rng.random((n, max(spec.max_turns - 1, 0))) < spec.turn_continue
    turns = 1 + np.cumprod(go_on, axis=1).sum(axis=1) if go_on.size else np.ones(n, dtype=np.int64)
    lat = spec.tool_latency_s * np.exp(spec.tool_latency_sigma * rng.standard_normal((n, max(spec.max_turns - 1, 1))))
    calls = np.arange(lat.shape[1])[None, :] < (turns - 1)[:, None]
    return turns.astype(np.int64), (lat * calls).sum(axis=1)


def get_workload(name: str) -> WorkloadSpec:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ConfigError([f"workload={name!r}: unknown (known: {', '.join(WORKLOADS)})"]) from None


# ------------------------------------------------------------ counter-based random numbers


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> int:
    """A 64-bit key from small integers (Python ints, exact and stable across runs)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = int(_mix(np.array([(h ^ (int(p) & _MASK)) & _MASK], dtype=np.uint64))[0])
        h = (h + 0x9E3779B97F4A7C15) & _MASK
    return h


def _uniform(key: int, ids: np.ndarray) -> np.ndarray:
    """Uniforms in (0, 1), one per id, from a hash of (key, id)."""
    x = _mix(ids.astype(np.uint64) ^ np.uint64(key))
    x = _mix(x + np.uint64(0x9E3779B97F4A7C15))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def _normal(key: int, ids: np.ndarray) -> np.ndarray:
    """Standard normals by Box-Muller from two hashed uniforms per id."""
    u1 = _uniform(key, ids)
    u2 = _uniform(key ^ 0x5851F42D4C957F2D, ids)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _name_id(workload: str) -> int:
    return zlib.crc32(workload.encode("utf-8"))


# ------------------------------------------------------------------------------ sampling


def sample_lengths_array(spec: WorkloadSpec, step: int, num_prompts: int, samples_per_prompt: int,
                         max_tokens: int, seed: int) -> np.ndarray:
    """Response lengths of one step as an int64 array of shape (num_prompts, samples_per_prompt)."""
    if num_prompts < 1 or samples_per_prompt < 1 or max_tokens < 1:
        raise ValueError("num_prompts, samples_per_prompt and max_tokens must be >= 1")
    wid = _name_id(spec.name)
    sigma_p = spec.prompt_share * spec.sigma
    sigma_r = math.sqrt(max(spec.sigma ** 2 - sigma_p ** 2, 0.0))
    step_noise = float(_normal(_key(seed, wid, _STREAM_STEP), np.array([step]))[0]) * spec.jitter
    mu = spec.log_median(step) + step_noise
    scale = math.log(max_tokens / spec.cap_tokens)  # rescale so the final cap is max_tokens
    cap = max(1, int(round(max_tokens * spec.cap_fraction(step))))

    prompt_ids = np.arange(num_prompts, dtype=np.uint64)
    a = _normal(_key(seed, wid, _STREAM_PROMPT, step), prompt_ids) * sigma_p
    # A sample's id packs (prompt, sample) so it does not depend on samples_per_prompt.
    sample_ids = (prompt_ids[:, None] << np.uint64(24)) | np.arange(samples_per_prompt, dtype=np.uint64)[None, :]
    e = _normal(_key(seed, wid, _STREAM_SAMPLE, step), sample_ids) * sigma_r
    runaway = _uniform(_key(seed, wid, _STREAM_RUNAWAY, step), sample_ids) < spec.runaway_prob(mu)
    log_len = mu + scale + a[:, None] + e
    lengths = np.ceil(np.exp(np.minimum(log_len, 60.0)))
    lengths = np.where(runaway, cap, lengths)
    return np.clip(lengths, 1, cap).astype(np.int64)


def sample_lengths(workload: str, step: int, num_prompts: int, samples_per_prompt: int, max_tokens: int,
                   seed: int) -> list[list[int]]:
    """For each prompt of absolute step `step`, the response lengths (ints in [1, max_tokens])
    of its samples.

    Deterministic in (workload, step, prompt index, sample index, seed) for a given
    `max_tokens`; never depends on the run's number of steps or on device counts.
    """
    arr = sample_lengths_array(get_workload(workload), step, num_prompts, samples_per_prompt,
                               max_tokens, seed)
    return arr.tolist()
