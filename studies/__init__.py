"""Result studies of issue 16: scripts that evaluate trained runs and write the README tables and plots."""


def accuracy_axes():
    """A fresh (fig, ax) for an accuracy-against-length plot (matplotlib without a display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=(6, 3.8))


def save_accuracy_plot(fig, ax, path, xlabel, ylabel, lengths=None, ymin=0.0):
    """Finish an accuracy_axes() plot (log2 length axis, ticks at `lengths` if given, accuracy ymin..1)
    and write it as a PNG."""
    from plot import save_png
    ax.set_xscale("log", base=2)
    if lengths:
        ax.set_xticks(lengths, [str(L) for L in lengths])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(ymin, 1 + 0.05 * (1 - ymin))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_png(fig, path)
