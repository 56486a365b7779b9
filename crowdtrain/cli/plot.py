"""The accuracy plot: validation accuracy of W_s over time, with each epoch's min-max band."""

from pathlib import Path

from crowdtrain.core.schemas import JobStatusOut


def plot_accuracy(st: JobStatusOut, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    by_epoch: dict[int, list] = {}
    for m in st.metrics:
        by_epoch.setdefault(m.epoch, []).append(m)
    for i, (_, pts) in enumerate(sorted(by_epoch.items())):
        t0, t1 = min(p.t for p in pts), max(p.t for p in pts)
        lo, hi = min(p.val_accuracy for p in pts), max(p.val_accuracy for p in pts)
        ax.fill_between(
            [t0, max(t1, t0 + 0.5)], lo, hi, color="tab:blue", alpha=0.15, label="epoch min-max" if i == 0 else None
        )
    ax.plot(
        [m.t for m in st.metrics],
        [m.val_accuracy for m in st.metrics],
        ".-",
        ms=3,
        lw=0.8,
        color="tab:blue",
        label="W_s after each merge",
    )
    ax.axhline(st.target_accuracy, color="tab:red", ls="--", lw=1, label=f"target {st.target_accuracy}")
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"job {st.job_id} {st.name}: {st.status}, {st.merges} merges, {st.current_epoch} epochs")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
