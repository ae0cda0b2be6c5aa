"""How many tokens to draft, per stream and per batch width: the step costs (`costs`), k per stream from the
measured α, D and V (`adaptive`), and the batch guard that turns the policy's speculation off at a width where it
is not faster in fact (`guard`)."""

from specrpc.engine.policy.adaptive import AcceptanceEstimate, AdaptivePolicy, BatchLoad, SharedRates, expected_tokens
from specrpc.engine.policy.costs import BatchCosts, CostModel, HostTimes, host_kind
from specrpc.engine.policy.guard import BatchGuard

__all__ = [
    "AcceptanceEstimate",
    "AdaptivePolicy",
    "BatchCosts",
    "BatchGuard",
    "BatchLoad",
    "CostModel",
    "HostTimes",
    "SharedRates",
    "expected_tokens",
    "host_kind",
]
