"""One module per residency policy: its config record and its registered PolicySpec (edgemoe.policies.registry).

Importing this package registers every policy, in the order their names are listed to users; edgemoe.policies
imports it, so the registry is complete once anything in edgemoe.policies is imported. Adding a policy is one
module here plus its import below (docs/adding-a-policy.md)."""

from __future__ import annotations

# isort: off
# the registration order is the order the names are listed to users in
from .static import StaticConfig
from .lru import LruConfig
from .dali import DaliConfig
from .daop import DaopConfig
from .manual import ManualConfig
from .promoe import PromoeConfig

# isort: on

__all__ = ["DaliConfig", "DaopConfig", "LruConfig", "ManualConfig", "PromoeConfig", "StaticConfig"]
