"""RL building blocks: the policy model and tokenizer, prompts, rewards, GRPO math, seeds.

No Ray here; torch and transformers only where a module needs them (seeds, data and rewards
import neither). The runtime wires these into device workers.
"""
