"""The roles a device worker holds: interfaces (base.py) and their backends (rollout_hf.py, ...).

Backends import lazily, through `roles.base.build_rollout_engine`, so choosing one never
imports another's heavy dependencies.
"""
