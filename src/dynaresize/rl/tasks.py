"""Tasks: the built-in tasks (`toy-count`, `arith`), and a user task from a dataset plus a
reward plug-in.

A user task: `task.dataset` (or its old name `task.prompts_file`), parquet or JSONL in verl's
or TRL's schema (`rl.dataset`), and `task.reward`, a function in any of the reward styles
(`rl.rewards`: `task.reward_style`, `auto` reads its signature). The math task `arith`
(`rl.math_task`) is a built-in dataset in verl's schema with a verl-style grader.

The toy task `toy-count`: each prompt asks for words starting with a letter ("write words
starting with b , for example bako bemi bute :"); the reward counts the response words that are
pseudo-words of the built-in vocabulary (rl/models.py) starting with that letter, as a fraction
of the response's words. It is verifiable (a rule, no model), and dense: a random tiny model
already scores about 0.06 with spread inside every group, so group-relative advantages are
non-zero from the first step. `toy-count` names one letter ("b"); `toy-count:bk` draws the
letter of each prompt from "b" and "k", which makes the model learn to read the prompt and
takes longer (docs/tasks.md has measured curves).

Held-out prompts (evaluation, dynaresize.driver.evaluation): the toy task also has a test split,
`toy_held_out_prompts`, drawn from another fixed seed and disjoint from the training prompts by
text, so training never samples a held-out prompt and the training prompt list (hence every
training sample) is the same whether a run evaluates or not.

Invariant: a task's prompt list is the same in every process (generated from a fixed seed),
and its reward function pickles by reference (a module-level function).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dynaresize.config import TaskConfig
from dynaresize.errors import UserError
from dynaresize.rl.dataset import load_dataset, schema
from dynaresize.rl.env import AGENT_ENVS, env_spec, load_env
from dynaresize.rl.models import CONSONANTS, pseudo_words
from dynaresize.rl.rewards import RewardFn, check_style, detect_style, load_reward

TOY_TASK = "toy-count"
MATH_TASK = "arith"
MATH_REWARD = "dynaresize.rl.math_task:compute_score"
# The built-in tokenizer has no chat template of its own; chat-message prompts (a dataset's, the
# math task's) are rendered with this one: "<bos>user : TEXT<eos><bos>assistant :".
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<bos>{{ m['role'] }} : {{ m['content'] }}<eos>{% endfor %}"
                      "{% if add_generation_prompt %}<bos>assistant :{% endif %}")
TOY_LETTERS = "b"
TOY_NUM_PROMPTS = 256
_TOY_SEED = 1234  # the toy prompt list is part of the task, not of a run: fixed seed
_TOY_HELD_OUT_SEED = 4321  # its test split: another fixed seed, texts of the training list excluded


@dataclass(frozen=True)
class Task:
    name: str
    prompts: list[dict]  # records with a `prompt` field (a string or chat messages); other fields go to the reward
    reward_fn: RewardFn | None  # in its own style (below), as the user wrote it; None: a multi-turn task
    reward_spec: str  # how to load reward_fn again in another process (a reward worker)
    reward_style: str = "dynaresize"  # dynaresize | verl | trl (rl.rewards) | env (the environment's rewards)
    about: str = ""  # one line for the run's console: the data's schema, the reward's style and why
    env_spec: str | None = None  # multi-turn: the environment (rl.env); its step rewards are the reward


def toy_prompts(num_prompts: int = TOY_NUM_PROMPTS, letters: str = TOY_LETTERS, seed: int = _TOY_SEED) -> list[dict]:
    """Prompts of the toy task: each names a letter from `letters` and shows three example words.

    All prompts have the same token count, so a rollout batches them together unpadded.
    """
    _check_letters(letters)
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        letter = letters[i % len(letters)]
        # The first words of a letter are in every built-in vocabulary of >= 520 tokens, so
        # each example is one token and all prompts have the same length.
        examples = rng.sample([w for w in pseudo_words() if w[0] == letter][:16], 3)
        out.append({"prompt": f"write words starting with {letter} , for example {' '.join(examples)} :",
                    "letter": letter})
    rng.shuffle(out)
    return out


def toy_held_out_prompts(num_prompts: int, letters: str = TOY_LETTERS) -> list[dict]:
    """The toy task's test split: `num_prompts` prompts, none with the text of a training prompt
    (`toy_prompts(letters=letters)`), none twice. Raises ValueError past the split's size."""
    _check_letters(letters)
    words = {letter: [w for w in pseudo_words() if w[0] == letter][:16] for letter in letters}
    # at most this many distinct texts exist (3 ordered example words per letter): past it, say so
    # at once rather than searching (200 draws per prompt asked for)
    most = sum(len(w) * (len(w) - 1) * (len(w) - 2) for w in words.values())
    if num_prompts > most:
        raise ValueError(f"the toy task has no {num_prompts} held-out prompts (at most {most})")
    train = {r["prompt"] for r in toy_prompts(letters=letters)}
    rng = random.Random(_TOY_HELD_OUT_SEED)
    out: list[dict] = []
    seen = set(train)
    for _ in range(200 * max(1, num_prompts)):
        if len(out) == num_prompts:
            break
        letter = letters[len(out) % len(letters)]
        text = f"write words starting with {letter} , for example {' '.join(rng.sample(words[letter], 3))} :"
        if text not in seen:
            seen.add(text)
            out.append({"prompt": text, "letter": letter})
    if len(out) < num_prompts:
        raise ValueError(f"the toy task has no {num_prompts} held-out prompts (found {len(out)})")
    return out


def toy_count_reward(prompt: str, response: str, fields: dict) -> float:
    """The fraction of the response's words (split on whitespace) that start with `fields["letter"]`."""
    letter = fields["letter"]
    words = response.split()
    if not words:
        return 0.0
    return sum(1 for w in words if w[0] == letter) / len(words)


def load_task(cfg: TaskConfig) -> Task:
    """The task a run trains on: a dataset with a reward plug-in, or a built-in task; with an
    environment (`task.env`, or a built-in multi-turn task) a multi-turn one. A bad dataset,
    reward or environment spec or reward signature raises a one-line UserError (before Ray starts)."""
    spec = env_spec(cfg)
    if spec is not None:
        return _multi_turn(cfg, spec)
    path = cfg.dataset or cfg.prompts_file
    if path is not None:
        if cfg.reward is None:
            raise UserError(f"task.reward: a dataset ({path}) needs a reward "
                            "(module:function or path/to/file.py:function)")
        prompts = load_dataset(path, cfg.columns)
        return _with_reward(cfg, str(path), prompts, cfg.reward, f"{path}: {len(prompts)} rows, {schema(prompts)} schema")
    name = cfg.name
    if name == MATH_TASK:
        from dynaresize.rl.math_task import dataset_file

        file = dataset_file()
        prompts = load_dataset(file)
        return _with_reward(cfg, name, prompts, cfg.reward or MATH_REWARD,
                            f"task {name}: {len(prompts)} problems in {file} (verl schema)")
    if name == TOY_TASK or name.startswith(TOY_TASK + ":"):
        letters = name.partition(":")[2] or TOY_LETTERS
        try:
            prompts = toy_prompts(letters=letters)
        except ValueError as exc:
            raise UserError(f"task.name={name!r}: {exc}") from None
        return _with_reward(cfg, name, prompts, cfg.reward or f"{__name__}:toy_count_reward", "")
    raise UserError(f"task.name={name!r}: unknown task (built-in: {TOY_TASK}, {TOY_TASK}:LETTERS, {MATH_TASK}; "
                    "or set task.dataset and task.reward)")


def _multi_turn(cfg: TaskConfig, spec: str) -> Task:
    """A task whose samples are trajectories in environment `spec` (rl/env.py): prompts from
    `task.dataset`, a built-in multi-turn task's, or a built-in single-turn task's."""
    load_env(spec)  # a bad spec is one line here, before Ray
    path = cfg.dataset or cfg.prompts_file
    name = cfg.name.partition(":")[0]
    if path is not None:
        prompts = load_dataset(path, cfg.columns)
        where = f"{path}: {schema(prompts)} schema"
    elif name in AGENT_ENVS:
        from dynaresize.rl import agent_task

        prompts, where = (agent_task.calc_prompts() if name == "agent-calc" else agent_task.guess_prompts()), f"task {name}"
    else:
        base = load_task(TaskConfig(name=cfg.name))
        prompts, where = base.prompts, f"task {cfg.name}"
    about = (f"{where}: {len(prompts)} prompts; multi-turn in environment {spec} (up to {cfg.max_turns} turns, "
             "the reward is the sum of its step rewards)")
    return Task(name=str(path or cfg.name), prompts=prompts, reward_fn=None, reward_spec="", reward_style="env",
                about=about, env_spec=spec)


def _with_reward(cfg: TaskConfig, name: str, prompts: list[dict], spec: str, about: str) -> Task:
    """The task with its reward loaded and its style resolved (`task.reward_style`) and checked."""
    fn = load_reward(spec)
    style, why = (cfg.reward_style, "set by task.reward_style") if cfg.reward_style != "auto" \
        else detect_style(fn, spec)
    check_style(fn, spec, style, {k for rec in prompts[:1] for k in rec if k != "prompt"})
    line = f"reward {spec}: {style} style ({why})"
    return Task(name=name, prompts=prompts, reward_fn=fn, reward_spec=spec, reward_style=style,
                about="; ".join(filter(None, (about, line))) if cfg.reward is not None or about else "")


def _check_letters(letters: str) -> None:
    bad = sorted(set(letters) - set(CONSONANTS))
    if not letters or bad or len(set(letters)) != len(letters):
        raise ValueError(f"letters {letters!r} must be distinct letters from {CONSONANTS!r}")


def decode_response(tokenizer, response_ids: list[int]) -> str:
    """The response text a reward sees: special tokens (EOS, padding) removed."""
    return tokenizer.decode(list(response_ids), skip_special_tokens=True)

