"""The roles a device worker holds: interfaces (base.py) and their backends (rollout_hf.py, ...).

Engines import lazily, through `roles.base.rollout_engine_from_config`, so choosing one never
imports another's heavy dependencies.
"""
