"""The batch policy interface, where ``docs/api.md`` and ``tqueue controller --policy`` point:
re-exported from :mod:`tqueue.controller.planning._batch_policies`, where it is defined."""

from .planning._batch_policies import BUILT_IN, Candidates, Policy, check, load

__all__ = ["BUILT_IN", "Candidates", "Policy", "check", "load"]
