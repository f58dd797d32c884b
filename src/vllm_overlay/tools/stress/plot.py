"""forward_sizes.png: histogram of forward sizes, band shaded, budget / cap / mnbt marked."""

from __future__ import annotations


def forward_sizes_png(path: str, sizes: dict[int, int], lo: int, hi: int, mnbt: int,
                      budget: int | None, cap: int | None, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    if sizes:
        top = max(max(sizes), mnbt)
        bins = max(16, min(128, top // 64))
        xs, ws = zip(*sorted(sizes.items()))
        ax.hist(xs, bins=bins, range=(0, top * 1.02), weights=ws, color="#4c72b0", label="forwards")
    ax.axvspan(lo, hi, color="#dd8452", alpha=0.25, label=f"band ({lo}, {hi}]")
    ax.axvline(mnbt, color="black", linestyle="-", label=f"max_num_batched_tokens {mnbt}")
    if budget is not None:
        ax.axvline(budget, color="green", linestyle="--", label=f"GDN buffer rows {budget}")
    if cap:
        ax.axvline(cap, color="red", linestyle=":", label=f"profile cap {cap}")
    ax.set_yscale("log")
    ax.set_xlabel("scheduled tokens per forward")
    ax.set_ylabel("forwards (log)")
    ax.set_title(title)
    ax.legend(loc="upper center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
