"""Staleness weights s(τ) of FedAsync (Xie, Koyejo, Gupta 2019, "Asynchronous Federated Optimization",
§5.2): how much an update computed τ merges ago still counts. No I/O."""

from dataclasses import dataclass


def constant_weight(tau: int) -> float:
    """s(τ) = 1: every update counts fully, however stale."""
    return 1.0


def polynomial_weight(tau: int, a: float) -> float:
    """s(τ) = (1 + τ)^−a: decays smoothly; a = 0 is the constant weight."""
    return float((1.0 + tau) ** -a)  # float ** float is typed Any (a negative base gives a complex)


def hinge_weight(tau: int, a: float, b: int) -> float:
    """s(τ) = 1 for τ <= b, else 1 / (a·(τ − b) + 1): full weight up to b merges late, then decaying."""
    return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)


@dataclass(frozen=True)
class StalenessWeight:
    """One of the weights above with its parameters (the job spec's staleness_weight, _a, _b)."""

    kind: str = "constant"
    a: float = 0.5
    b: int = 4

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "polynomial", "hinge"):
            raise ValueError(f"unknown staleness_weight {self.kind!r}")
        if self.a < 0 or self.b < 0:
            raise ValueError(f"staleness_a and staleness_b must be >= 0, got {self.a}, {self.b}")

    def __call__(self, tau: int) -> float:
        # τ < 0 cannot happen (versions only grow); count such an update as fresh rather than fail it.
        tau = max(int(tau), 0)
        if self.kind == "polynomial":
            return polynomial_weight(tau, self.a)
        if self.kind == "hinge":
            return hinge_weight(tau, self.a, self.b)
        return constant_weight(tau)
