"""The built-in multi-turn tasks: `agent-calc` (arithmetic with a calculator tool, which the model
must call to score) and `agent-guess` (a pure-text two-turn guessing game). Both are examples of
the environment protocol (`rl.env`) and run with `--preset agent` (`agent-calc`).

`agent-calc`: a chat prompt asks for a product or sum of two- and three-digit numbers and
describes the `calculator` tool; `CalculatorEnv` (a `ToolEnv`) runs the calculator on the
model's `<tool_call>` and gives the result back as a `tool` message; a turn without a tool call
with a number is the final answer, which scores 1.0 when its last number is the right one and
at least one calculator call was made, else 0.0; a turn with neither gets a reminder as a user
message and the trajectory goes on (so the untrained tiny model's trajectories are multi-turn
too, ending at `task.max_turns`).

`agent-guess`: a text prompt asks for a number from 1 to 9; `GuessEnv` answers a wrong first
guess with "higher" or "lower" as text, and the second guess ends the game. A right guess
scores 1.0 on the first turn, 0.5 on the second.

Prompts come from a fixed seed (the same list in every process). The tiny built-in model does
not learn to call tools in a few steps; these tasks are there to run the multi-turn machinery
end to end with real engines.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from dynaresize.rl.env import ToolEnv

NUM_PROMPTS = 256
SEED = 77  # part of the task, not of a run
TOOL_PROMPT = ('You can call a calculator: write <tool_call>{"name": "calculator", "arguments": '
               '{"expression": "12*34"}}</tool_call> and read its result. Give the final number without a tool call.')
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """+ - * / and parentheses over numbers (no names, no calls): the tool's whole language."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    if len(expression) > 200:
        raise ValueError("expression too long")
    value = ev(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def last_number(text: str) -> int | None:
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return int(found[-1]) if found else None


def calc_prompts(num: int = NUM_PROMPTS, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        a, b = rng.randint(12, 999), rng.randint(12, 99)
        op = rng.choice("*+")
        value = a * b if op == "*" else a + b
        out.append({"prompt": [{"role": "system", "content": TOOL_PROMPT},
                               {"role": "user", "content": f"What is {a} {op} {b}?"}],
                    "answer": value})
    return out


def guess_prompts(num: int = NUM_PROMPTS, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed + 1)
    return [{"prompt": "guess my number from 1 to 9 :", "secret": rng.randint(1, 9)} for _ in range(num)]


class CalculatorEnv(ToolEnv):
    """`agent-calc`: see the module docstring."""

    tools = {"calculator": calculator}

    def step(self, action: str):
        if last_number(action) is None and "<tool_call>" not in action:  # neither a call nor an answer
            return [{"role": "user", "content": "Call the calculator or give a number."}], 0.0, False
        return super().step(action)

    def score(self, answer: str) -> float:
        return 1.0 if self.calls and last_number(answer) == int(self.sample["answer"]) else 0.0


class GuessEnv:
    """`agent-guess`: see the module docstring (pure text observations)."""

    def reset(self, sample: dict):
        self.secret, self.turn = int(sample["secret"]), 0
        return None

    def step(self, action: str):
        self.turn += 1
        guess = last_number(action)
        if guess == self.secret:
            return None, 1.0 if self.turn == 1 else 0.5, True
        if self.turn >= 2:
            return None, 0.0, True
        hint = "higher" if guess is None or guess < self.secret else "lower"
        return f" {hint} , guess again :", 0.0, False
