"""Full cache: no eviction. The quality ceiling every other policy is compared against."""

from dataclasses import dataclass

from learnkv.policies.base import Policy


@dataclass
class FullCache(Policy):
    """Keeps every token; the budget is ignored."""

    name = "full"
    evicts = False
    needs_attention = False
