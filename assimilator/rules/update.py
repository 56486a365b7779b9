"""What every merge rule sees and promises: one `Update` at a time, W_s and the rule's state in place."""

from dataclasses import dataclass
from typing import Protocol

from crowdtrain.tensors import Params


@dataclass(frozen=True)
class Update:
    """One result as a rule sees it."""

    client: Params  # W_c, the host's weights (every tensor of the manifest)
    delta: Params  # Δ = W_c − W_base over the floating-point tensors
    staleness: int  # τ = W_s version at merge − the version the host started from
    epoch: int  # the workunit's epoch (1-based)


class Rule(Protocol):
    def initial_state(self, server: Params) -> Params:
        """The state the rule keeps beside W_s (empty for a stateless rule).

        Its names, shapes and dtypes are fixed for the life of the job: `apply` changes the values
        only, so the parameter store can keep the state as one blob and update it in place.
        """
        ...

    def apply(self, server: Params, state: Params, update: Update) -> None:
        """Merge `update` into `server` and `state`, both in place (never replacing an array)."""
        ...
