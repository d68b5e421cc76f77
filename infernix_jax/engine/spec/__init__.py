"""Speculative decoding: drafters propose tokens (draft.py), one verify step scores them all and
keeps what the target model agrees with (verify.py, engine/steps.py), and a policy picks, per
sequence and round, whether and how much to draft from measured round times and acceptance
(policy.py)."""
from .draft import MAX_NODES, Draft
from .verify import DraftArrays

__all__ = ["MAX_NODES", "Draft", "DraftArrays"]
