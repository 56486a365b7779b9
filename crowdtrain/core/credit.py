"""Credit: what a host earns for a result merged into W_s, in BOINC's unit. No I/O.

A cobblestone is 1/200 of a day of a 1 GFLOPS machine, 4.32e11 floating-point operations (BOINC's
credit unit, https://boinc.berkeley.edu/wiki/Computation_credit). A result's work is what the
scheduler asked for, never what the host says it did: the shard's examples, times the recipe's
local epochs and the share of them this host was given, times the FLOPs of training on one example.
The examples a result counts on the pages and in a job's progress are the same figure.
"""

COBBLESTONE_FLOPS = 4.32e11


def assigned_examples(examples: int, local_epochs: int, local_fraction: float) -> int:
    """The examples one result trains, as the scheduler asked: `examples` of its shard, times the
    recipe's local epochs and the share of them this host was given. What the pages and the job's
    progress count for a result; the host's own figure is never counted."""
    return round(examples * local_epochs * local_fraction)


def flops_credit(flops: float) -> float:
    """Cobblestones for `flops` floating-point operations (an expert host's answers)."""
    return flops / COBBLESTONE_FLOPS


def result_credit(examples: int, local_epochs: int, local_fraction: float, training_flops: int) -> float:
    """Cobblestones for one merged result."""
    return examples * local_epochs * local_fraction * training_flops / COBBLESTONE_FLOPS
