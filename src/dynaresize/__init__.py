"""dynaresize: move devices between rollout and training while an RL job runs."""

__version__ = "0.1.0"
