"""`posbench inspect RUN_DIR`: plots that explain a run's curve, written beside its results.

- inspect_positions.png: a learned absolute table (GPT-2's helix): its rows on their first three
  principal components, and cos(P[t], P[t+Δ]) against Δ averaged over trained rows t < L.
- inspect_attention.png: per layer and head, the mean attention mass by lag (log-binned) on a few
  validation windows at each inspected length, and the mass on keys with lag > L at lengths past L
  (docs/encodings.md#group-family: far logits that only decay to 0 keep a share that grows with
  the length).
- inspect_by_length.png: per layer and head against the inspected length, the attention entropy
  and the mass on the first token (the sink), both means over queries, and the mass at lag > L:
  why a curve bends past L (attention spread thinner, parked on the sink, or reaching too far).
- inspect.json: the numbers of the plots.
Only these four files are written (atomically); results and the checkpoint are never touched.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from posbench.attention.paths import BLOCK_ELEMENTS, attention_probs
from posbench.core.errors import ConfigError
from posbench.data import prepare
from posbench.evaluations.perplexity import eval_plan
from posbench.core.io import write_json
from posbench.core.plots import plain_length_axes, pyplot, save_figure
from posbench.core.device import resolve_device
from posbench.runs.run import trained_model

TABLE = "encoding.tables.0"  # the learned absolute table (encoding=learned), rows x D
WINDOWS = 4  # validation windows per length: enough for a mean, cheap on CPU


def inspect_run(run_dir: Path, lengths: Optional[List[int]] = None) -> dict:
    """Write the inspect plots and inspect.json into `run_dir`; lengths default to L and 4L."""
    trained = trained_model(run_dir)  # on CPU until its config names the device
    cfg = trained.config
    train_len = cfg.train.seq_len
    lengths = lengths or [train_len, 4 * train_len]
    data = prepare(cfg.dataset)
    trained.require_corpus(data)
    model = trained.model.to(resolve_device(cfg.device))
    record = {"encoding": cfg.encoding.name, "train_len": train_len, "windows": WINDOWS}
    written: List[Path] = []  # every file this inspect writes, printed at the end
    weights = model.state_dict()
    if TABLE in weights:
        table = weights[TABLE].float().cpu()
        record["positions"] = position_summary(table, train_len)
        plot_positions(table, train_len, record["positions"], run_dir / "inspect_positions.png")
        written.append(run_dir / "inspect_positions.png")
    else:
        record["positions"] = None
        print(f"inspect: encoding={cfg.encoding.name} has no learned position table; "
              "skipped inspect_positions.png")
    record["attention"] = attention_summary(model, data, cfg, lengths)
    plot_attention(record["attention"], train_len, run_dir / "inspect_attention.png")
    plot_by_length(record["attention"], train_len, run_dir / "inspect_by_length.png")
    write_json(run_dir / "inspect.json", record)
    written += [run_dir / "inspect_attention.png", run_dir / "inspect_by_length.png",
                run_dir / "inspect.json"]
    print("wrote " + ", ".join(str(path) for path in written))
    return record


# ---- learned positions ----------------------------------------------------------------------

def position_summary(table: torch.Tensor, train_len: int) -> dict:
    """PCA fitted on the trained rows (untrained ones are init noise that would swamp it), all rows
    projected; mean cos(P[t], P[t+Δ]) over trained t with t+Δ inside the table."""
    trained = table[:min(train_len, len(table))]
    mean = trained.mean(0)
    _, s, v = torch.linalg.svd(trained - mean, full_matrices=False)
    pcs = (table - mean) @ v[:3].T
    unit = torch.nn.functional.normalize(table, dim=1)
    gram = unit[:len(trained)] @ unit.T
    cos = [torch.diagonal(gram, offset=d).mean().item() for d in range(len(table))]
    return {"rows": len(table), "explained_variance": (s[:3] ** 2 / (s ** 2).sum()).tolist(),
            "pcs": pcs.tolist(), "cos_by_offset": cos}


def plot_positions(table: torch.Tensor, train_len: int, summary: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 8))
    pcs, t = np.array(summary["pcs"]), np.arange(summary["rows"])
    trained = t < train_len
    var = summary["explained_variance"]
    for ax, (a, b) in zip(axes[0], ((0, 1), (1, 2))):
        ax.plot(pcs[:, a], pcs[:, b], color="lightgray", linewidth=0.5, zorder=0)
        dots = ax.scatter(pcs[trained, a], pcs[trained, b], c=t[trained], cmap="viridis", s=8,
                          label=f"trained rows t < {train_len}")
        ax.scatter(pcs[~trained, a], pcs[~trained, b], c="gray", marker="x", s=6,
                   label="untrained rows")
        ax.set_xlabel(f"PC{a + 1} ({var[a]:.0%} of variance)")
        ax.set_ylabel(f"PC{b + 1} ({var[b]:.0%})")
        ax.legend(fontsize=7)
    fig.colorbar(dots, ax=axes[0, 1], label="position t")
    for i in range(pcs.shape[1]):
        axes[1, 0].plot(t, pcs[:, i], label=f"PC{i + 1}")
    axes[1, 0].set_xlabel("position t")
    axes[1, 0].set_ylabel("projection")
    axes[1, 1].plot(t, summary["cos_by_offset"])
    axes[1, 1].set_xlabel("offset Δ")
    axes[1, 1].set_ylabel(f"mean cos(P[t], P[t+Δ]) over t < {train_len}")
    for ax in axes[1]:
        ax.axvline(train_len, color="gray", linestyle="--", label=f"train length {train_len}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"learned position table ({summary['rows']} x {table.shape[1]})")
    save_figure(plt, fig, path)


# ---- attention by lag -----------------------------------------------------------------------

def lag_bins(longest: int) -> List[List[int]]:
    """Inclusive lag ranges [0,0], [1,1], [2,3], [4,7], ... up to longest - 1."""
    bins, lo = [[0, 0]], 1
    while lo < longest:
        bins.append([lo, min(2 * lo, longest) - 1])
        lo *= 2
    return bins


@torch.no_grad()
def lag_mass(model, x: torch.Tensor):
    """(layers, H, T) attention mass at each lag summed over the windows x (B, T) and their
    queries, and (layers, H) sums over the same queries of the entropy (nats) and of the mass on
    the first token. Each attention module's input is caught by a pre-hook and turned into q, k
    by the module itself, so the probabilities are the ones the forward uses."""
    T = x.shape[1]
    totals, entropies, sinks = [], [], []

    def catch(attn, args):
        inp, pos, encoding = args[:3]  # and segments: None, evaluation cuts no sequence
        q, k, _ = attn.heads(inp, pos, encoding)
        B, H = q.shape[:2]
        total = torch.zeros(B, H, T, dtype=torch.float64, device=x.device)
        entropy = torch.zeros(H, dtype=torch.float64, device=x.device)
        sink = torch.zeros(H, dtype=torch.float64, device=x.device)
        rows = max(1, min(T, BLOCK_ELEMENTS // (B * H * T)))  # bounds memory like blockwise
        for start in range(0, T, rows):
            probs = attention_probs(q, k, pos, *encoding.at_layer(attn.layer), start,
                                    min(T, start + rows), x=inp, span=attn.span,
                                    sinks=attn.sinks)
            lag = (torch.arange(start, start + probs.shape[2], device=x.device).view(-1, 1)
                   - torch.arange(probs.shape[3], device=x.device)).clamp(min=0)  # future: p = 0
            total.scatter_add_(2, lag.flatten().expand(B, H, -1),
                               probs.flatten(2).to(torch.float64))
            p = probs.to(torch.float64)
            entropy -= torch.special.xlogy(p, p).sum((0, 2, 3))  # 0 log 0 = 0 (masked keys)
            sink += p[..., 0].sum((0, 2))
        totals.append(total.sum(0))
        entropies.append(entropy)
        sinks.append(sink)

    hooks = [block.attn.register_forward_pre_hook(catch) for block in model.blocks]
    try:
        model.hidden(x)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(totals).cpu(), torch.stack(entropies).cpu(), torch.stack(sinks).cpu()


def _windows(data, cfg, length: int) -> torch.Tensor:
    """WINDOWS nonoverlapping validation windows of `length` input tokens, spread over the
    validation documents the way evaluation spreads its own (tasks: WINDOWS instances)."""
    eval_cfg = OmegaConf.merge(cfg.eval, {"protocol": "nonoverlapping", "lengths": [length],
                                          "tokens": WINDOWS * length})
    rows, _ = eval_plan(data, length, eval_cfg).rows(0, WINDOWS)
    return torch.from_numpy(rows[:, :-1].astype(np.int64))


def attention_summary(model, data, cfg, lengths: List[int]) -> dict:
    """Per length: mass[layer][head][bin], the mean over queries (each row sums to 1),
    mass_beyond_train_len[layer][head], the mean over queries t > L of the mass at lag > L, and
    the means over all queries of entropy[layer][head] (nats) and sink_mass[layer][head]."""
    L, device = cfg.train.seq_len, next(model.parameters()).device
    bins = lag_bins(max(lengths))
    out = {"lag_bins": bins, "lengths": []}
    for length in lengths:
        x = _windows(data, cfg, length).to(device)
        try:
            per_lag, entropy, sink = lag_mass(model, x)
        except ValueError as err:  # e.g. a position past a learned table
            raise ConfigError(f"length {length} cannot be inspected: {err}; expected lengths "
                              "the model can read (--lengths)") from None
        queries = x.shape[0] * length
        mass = torch.stack([per_lag[..., lo:hi + 1].sum(-1) for lo, hi in bins], -1) / queries
        beyond = None
        if length > L + 1:  # queries t > L exist: t = L+1 .. length-1
            beyond = (per_lag[..., L + 1:].sum(-1) / (x.shape[0] * (length - L - 1))).tolist()
        out["lengths"].append({"length": length, "mass": mass.tolist(),
                               "mass_beyond_train_len": beyond,
                               "entropy": (entropy / queries).tolist(),
                               "sink_mass": (sink / queries).tolist()})
    return out


def plot_attention(summary: dict, train_len: int, path: Path) -> None:
    """Rows: layers; columns: lengths; one curve per head."""
    plt = pyplot()
    per_length = summary["lengths"]
    n_layer = len(per_length[0]["mass"])
    # constrained: each panel's title clears the lag label of the panel above
    fig, axes = plt.subplots(n_layer, len(per_length), squeeze=False, layout="constrained",
                             figsize=(5 * len(per_length), 3.2 * n_layer))
    starts = [lo for lo, _ in summary["lag_bins"]]
    for col, point in enumerate(per_length):
        for layer, heads in enumerate(point["mass"]):
            ax = axes[layer, col]
            shown = sum(lo < point["length"] for lo in starts)  # bins this length reaches
            for head, mass in enumerate(heads):
                beyond = point["mass_beyond_train_len"]
                extra = f" (lag > {train_len}: {beyond[layer][head]:.3f})" if beyond else ""
                ax.plot(starts[:shown], mass[:shown], marker=".", label=f"head {head}{extra}")
            ax.axvline(train_len, color="gray", linestyle="--")
            ax.set_xscale("symlog", base=2, linthresh=1)
            ax.set_xlim(left=0)
            plain_length_axes(ax, starts[:shown], log_y=False)  # 0, 1, 2, 4: not 2^k
            ax.set_title(f"layer {layer}, length {point['length']}", fontsize=9)
            ax.set_xlabel("lag (bin [x, 2x); dashed: train length)", fontsize=8)
            ax.set_ylabel("mean attention mass", fontsize=8)
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=6)
    save_figure(plt, fig, path)


def plot_by_length(summary: dict, train_len: int, path: Path) -> None:
    """Entropy, sink mass and mass at lag > L against the inspected length: one panel each, a
    colour per layer, a line per head."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    points = summary["lengths"]
    colours = plt.get_cmap("tab10").colors
    panels = (("entropy", "attention entropy (nats, mean over queries)"),
              ("sink_mass", "mass on the first token (mean over queries)"),
              ("mass_beyond_train_len", f"mass at lag > {train_len} (queries t > {train_len})"))
    for ax, (key, label) in zip(axes, panels):
        for layer, heads in enumerate(points[0]["mass"]):
            for head in range(len(heads)):
                xy = [(p["length"], p[key][layer][head]) for p in points if p[key] is not None]
                if xy:
                    ax.plot(*zip(*xy), marker=".", color=colours[layer % len(colours)],
                            label=f"layer {layer}" if head == 0 else None)
        ax.axvline(train_len, color="gray", linestyle="--")
        ax.set_xscale("log", base=2)
        plain_length_axes(ax, [p["length"] for p in points] + [train_len], log_y=False)
        ax.set_xlabel("inspected length (dashed: train length)", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(plt, fig, path)
