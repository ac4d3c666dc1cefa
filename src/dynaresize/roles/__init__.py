"""The roles a device worker holds: interfaces (base.py) and their backends (rollout_hf.py, ...).

Engines import lazily, through `roles.factory.rollout_engine_from_config`, so choosing one never
imports another's heavy dependencies, and the interface module never imports a backend.
"""
