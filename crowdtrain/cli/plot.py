"""The accuracy plot: validation accuracy of W_s after each merge, with each epoch's min-max band,
against the seconds since the job started or the training examples merged so far."""

from enum import StrEnum
from pathlib import Path

from crowdtrain.core.schemas_jobs import JobStatusOut, MetricPoint


class Against(StrEnum):
    """What the plot's x axis counts."""

    time = "time"
    examples = "examples"


_X_LABEL = {Against.time: "seconds since the job started", Against.examples: "training examples merged into W_s"}


class NothingToPlot(ValueError):
    """The job has no point to draw on the axis asked for."""


def x_of(m: MetricPoint, against: Against) -> float:
    if against is Against.time:
        return m.t
    if m.examples is None:
        raise NothingToPlot("this job's merges do not count examples (dedloc mode): plot it against time")
    return float(m.examples)


def plot_accuracy(st: JobStatusOut, path: Path, against: Against = Against.time) -> Path:
    """Write the plot of `st.metrics` (fetched with ?metrics=true) to `path` (PNG); NothingToPlot if
    `against` cannot place the job's points. A job without points gets empty axes."""
    xs = [x_of(m, against) for m in st.metrics]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    by_epoch: dict[int, list[tuple[float, float]]] = {}
    for x, m in zip(xs, st.metrics, strict=True):
        by_epoch.setdefault(m.epoch, []).append((x, m.val_accuracy))
    # A band must be visible even for one point: at least 1/200 of the axis wide.
    min_width = max((max(xs, default=0) - min(xs, default=0)) / 200, 0.5 if against is Against.time else 1.0)
    for i, (_, pts) in enumerate(sorted(by_epoch.items())):
        x0, x1 = min(x for x, _ in pts), max(x for x, _ in pts)
        lo, hi = min(a for _, a in pts), max(a for _, a in pts)
        ax.fill_between(
            [x0, max(x1, x0 + min_width)],
            lo,
            hi,
            color="tab:blue",
            alpha=0.15,
            label="epoch min-max" if i == 0 else None,
        )
    ax.plot(
        xs, [m.val_accuracy for m in st.metrics], ".-", ms=3, lw=0.8, color="tab:blue", label="W_s after each merge"
    )
    ax.axhline(st.target_accuracy, color="tab:red", ls="--", lw=1, label=f"target {st.target_accuracy}")
    ax.set_xlabel(_X_LABEL[against])
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"job {st.job_id} {st.name}: {st.status}, {st.merges} merges, {st.current_epoch} epochs")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
