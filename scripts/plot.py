#!/usr/bin/python3
"""plot.py - draws the examples' metrics files (--metrics FILE, JSON lines) as pictures.

    scripts/plot.py RUN.jsonl [MORE.jsonl ...] -o run.png [--title TEXT] [--smooth N]

Each FILE is read together with its per-rank siblings (run.jsonl, run.rank1.jsonl, ...). The
figure has up to four panels, each drawn when the files hold its data:
  - training loss per step, one line per worker (moving average over --smooth steps, raw in
    light colour), one colour per file when several runs are compared;
  - the evaluation metric after each epoch, or every few steps (test accuracy, validation loss, ...);
  - throughput (samples/s or tokens/s, moving average) per worker;
  - the mean time of each phase of a step per worker (stacked bars: forward, backward, step ...).
The output format follows the extension of -o (png, svg, pdf). Needs matplotlib (Debian's
python3-matplotlib, for /usr/bin/python3, which the first line names); run by another
interpreter without matplotlib (`python3 scripts/plot.py` with a pyenv or conda python first in
PATH), it runs itself again with /usr/bin/python3. Uses the non-interactive Agg backend, so it
runs without a display.
"""
import argparse
import glob
import json
import math
import os
import sys

DEBIAN_PYTHON = "/usr/bin/python3"
try:
    import matplotlib
except ImportError:
    if os.path.realpath(sys.executable) != os.path.realpath(DEBIAN_PYTHON) and \
            os.access(DEBIAN_PYTHON, os.X_OK) and not os.environ.get("TD_PLOT_REEXEC"):
        os.environ["TD_PLOT_REEXEC"] = "1"
        os.execv(DEBIAN_PYTHON, [DEBIAN_PYTHON] + sys.argv)
    sys.exit("plot.py: matplotlib is missing: install Debian's python3-matplotlib "
             "(scripts/install-deps.sh) and run with /usr/bin/python3")

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def siblings(path):
    """The file itself, then its .rank<r> siblings in rank order."""
    root, ext = os.path.splitext(path)
    found = glob.glob(f"{glob.escape(root)}.rank*{ext}") if ext else glob.glob(f"{glob.escape(path)}.rank*")
    def rank_of(p):
        tail = p[len(root) + 5:] if ext else p[len(path) + 5:]
        digits = tail[: len(tail) - len(ext)] if ext else tail
        return int(digits) if digits.isdigit() else 1 << 30
    return [path] + sorted((p for p in found if rank_of(p) < 1 << 30), key=rank_of)


def load(path):
    """Records of a run (the file and its siblings), skipping lines that do not parse."""
    records = []
    for p in siblings(path):
        with open(p, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    print(f"plot.py: {p}:{n}: skipped ({e})", file=sys.stderr)
    return records


def moving_average(ys, n):
    out, acc, window = [], 0.0, []
    for y in ys:
        window.append(y)
        acc += y
        if len(window) > n:
            acc -= window.pop(0)
        out.append(acc / len(window))
    return out


def finite(v):
    return isinstance(v, (int, float)) and math.isfinite(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="metrics files (rank 0's; siblings are found)")
    ap.add_argument("-o", "--out", required=True, help="output image (.png, .svg, .pdf)")
    ap.add_argument("--title", default=None)
    ap.add_argument("--smooth", type=int, default=20, help="moving-average window in steps")
    args = ap.parse_args()

    runs = []
    for path in args.files:
        recs = load(path)
        if not recs:
            sys.exit(f"plot.py: {path}: no records")
        runs.append((os.path.basename(path), recs))

    steps = any(r.get("kind") == "step" for _, recs in runs for r in recs)
    evals = any(r.get("kind") == "eval" for _, recs in runs for r in recs)
    rate = any(r.get("kind") == "step" and ("samples_per_s" in r or "tokens_per_s" in r)
               for _, recs in runs for r in recs)
    phases = any(r.get("kind") == "step" and r.get("phases") for _, recs in runs for r in recs)
    panels = [p for p, on in (("loss", steps), ("eval", evals), ("rate", rate),
                              ("phases", phases)) if on]
    if not panels:
        sys.exit("plot.py: nothing to draw (no step or eval records)")
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.0 * rows), squeeze=False)
    ax_of = {p: axes[i // cols][i % cols] for i, p in enumerate(panels)}
    for i in range(len(panels), rows * cols):
        axes[i // cols][i % cols].axis("off")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    eval_by = "epoch"
    for ri, (name, recs) in enumerate(runs):
        label_run = f"{name}: " if len(runs) > 1 else ""
        by_worker = {}
        for r in recs:
            if r.get("kind") == "step" and finite(r.get("loss")):
                by_worker.setdefault((r.get("rank", 0), r.get("worker", "")), []).append(r)
        for wi, ((rank, worker), rs) in enumerate(sorted(by_worker.items())):
            c = colours[(ri * 4 + wi) % len(colours)]
            xs = [r["step"] for r in rs]
            if "loss" in ax_of:
                ys = [r["loss"] for r in rs]
                ax_of["loss"].plot(xs, ys, color=c, alpha=0.2, linewidth=0.8)
                ax_of["loss"].plot(xs, moving_average(ys, args.smooth), color=c,
                                   label=f"{label_run}{worker or 'rank %d' % rank}")
            if "rate" in ax_of:
                key = "tokens_per_s" if any("tokens_per_s" in r for r in rs) else "samples_per_s"
                pts = [(r["step"], r[key]) for r in rs if finite(r.get(key))]
                if pts:
                    ax_of["rate"].plot([p[0] for p in pts],
                                       moving_average([p[1] for p in pts], args.smooth), color=c,
                                       label=f"{label_run}{worker or 'rank %d' % rank}")
                    ax_of["rate"].set_ylabel(key.replace("_per_s", "/s"))
        if "eval" in ax_of:
            metrics = {}
            for r in recs:
                if r.get("kind") != "eval":
                    continue
                if "step" in r:  # programs that count steps (gpt) evaluate every N steps
                    eval_by = "step"
                for k, v in r.items():
                    if k not in ("kind", "rank", "worker", "time_s", "epoch", "step") \
                            and finite(v):
                        metrics.setdefault(k, []).append((r.get("step", r.get("epoch")), v))
            for mi, (k, pts) in enumerate(sorted(metrics.items())):
                pts.sort()
                ax_of["eval"].plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                   color=colours[(ri * 4 + mi) % len(colours)],
                                   label=f"{label_run}{k}")
        if "phases" in ax_of and ri == 0:
            totals = {}
            for (rank, worker), rs in sorted(by_worker.items()):
                sums, n = {}, 0
                for r in rs:
                    ph = r.get("phases") or {}
                    if not ph:
                        continue
                    n += 1
                    for k, v in ph.items():
                        if finite(v):
                            sums[k] = sums.get(k, 0.0) + v
                if n:
                    totals[worker or f"rank {rank}"] = {k: v / n * 1e3 for k, v in sums.items()}
            names = []  # in the order the steps list them
            for t in totals.values():
                names += [k for k in t if k not in names]
            bottoms = [0.0] * len(totals)
            for ki, k in enumerate(names):
                vals = [t.get(k, 0.0) for t in totals.values()]
                ax_of["phases"].bar(list(totals), vals, bottom=bottoms,
                                    color=colours[ki % len(colours)],
                                    label=k.replace("_s", ""))
                bottoms = [b + v for b, v in zip(bottoms, vals)]
            ax_of["phases"].set_ylabel("ms per step (mean)")
            ax_of["phases"].set_title("time per phase of a step")

    if "loss" in ax_of:
        ax_of["loss"].set_xlabel("step")
        ax_of["loss"].set_ylabel("training loss")
        ax_of["loss"].set_title(f"training loss (moving average over {args.smooth} steps)")
    if "eval" in ax_of:
        ax_of["eval"].set_xlabel(eval_by)
        ax_of["eval"].xaxis.get_major_locator().set_params(integer=True)
        ax_of["eval"].set_title("evaluation after each epoch" if eval_by == "epoch" else
                                "evaluation every few steps")
    if "rate" in ax_of:
        ax_of["rate"].set_xlabel("step")
        ax_of["rate"].set_title("throughput per worker")
    for ax in ax_of.values():
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"plot.py: wrote {args.out}")


if __name__ == "__main__":
    main()
