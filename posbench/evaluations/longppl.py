"""eval.longppl: perplexity on the key tokens only, the tokens that need long context (LongPPL,
Fang et al., ICLR 2025, arXiv 2410.23771).

Perplexity averages over every token, and most tokens are predicted as well from a few hundred
tokens of context as from all of them; LongPPL scores only the key tokens. At each eval length n,
on the windows the perplexity protocol scores (the same tokens for every encoding), an evaluator
model computes every scored target's loss twice: with the whole window before it (long) and with
only the `trunc_len` tokens before it (short: the model run afresh on those tokens, positions
from 0, their first replaced by BOS under dataset.bos as every window's is). Target i is a key
token when

    loss_short(i) - loss_long(i) > alpha   and   loss_long(i) < beta          (nats)

as the official `longppl` package's find_key_token keeps it (in its terms LSD > alpha and
LCL > beta, LCL a log-probability and beta = -2; here beta bounds the loss, so 2). Its short
context is the raw tokens; here, under dataset.bos, BOS takes the first of them, as at the
start of every window the model was trained on. A target whose short context
would reach back to the window's start (at most trunc_len tokens before it) is never one: its two
contexts are one. LongPPL(n) = exp(the evaluated run's
mean long-context loss over the key tokens), reported beside ppl(n), with the count of key
tokens and their share of the scored tokens; null with a count of 0 where there are none.

The evaluator is the run itself (evaluator: null) or another finished run of the same corpus and
tokenizer (evaluator: RUN_DIR), so that every run it judges is scored on one set of key tokens
(its eval-time options are its own, from its config).

Cost: the long pass is one perplexity pass (two with another evaluator). The short pass is the
expensive part: with block=1 each of the about tokens*(1 - trunc_len/n) eligible targets takes a
forward of trunc_len tokens of its own, about trunc_len times the perplexity pass's tokens at
every length above trunc_len. block=b lets b consecutive targets share one forward of
trunc_len+b-1 tokens, blocks laid from the window's start (their short contexts then hold
trunc_len to trunc_len+b-1 tokens, as the reference's sliding_window does: 1024 at trunc_len
4096; the first block's targets are not eligible), (trunc_len+b-1)/b times the perplexity pass.
Another evaluator's key tokens are cached beside it (longppl_cache.py): of the runs it judges,
the first runs its two passes, the others read them back. Memory is that of one perplexity
batch (eval.batch_tokens tokens per forward, the head's logits in chunks), and the per-token
losses of one length (float64, 3 x eval.tokens) on the CPU.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from posbench.core.errors import ConfigError, require
from posbench.core.plots import plot_curves
from posbench.core.progress import Bar
from posbench.data.base import dataset_class
from posbench.data.documents import file_digest
from posbench.data.windows import EvalPlan
from posbench.evaluations.base import (Section, SectionConfig, eval_config, register,
                                       eval_options, scored_within_memory, set_eval_options,
                                       with_train_length)
from posbench.evaluations.longppl_cache import FOLDER, cached_keys, windows_digest
from posbench.evaluations.perplexity import plans

HEAD_CHUNK = 4096  # targets whose logits exist at once in the short pass


@dataclass
class LongPPLConfig(SectionConfig):
    """eval.longppl: perplexity on the key tokens (language-model runs only)."""
    # a key token's long context lowers its loss by more than alpha nats...
    alpha: float = 2.0
    # ...and its long-context loss is below beta nats (the reference's beta=-2 on log-probs)
    beta: float = 2.0
    # the short context, in tokens; null: the run's training length (train.seq_len)
    trunc_len: Optional[int] = None
    # consecutive targets that share one short-context forward; 1: each target gets exactly
    # trunc_len tokens of short context
    block: int = 1
    # the finished run dir whose model chooses the key tokens; null: the run itself
    evaluator: Optional[str] = None


def trunc_length(cfg: LongPPLConfig, run_cfg) -> int:
    return cfg.trunc_len if cfg.trunc_len is not None else run_cfg.train.seq_len


def eval_lengths(run_cfg) -> List[int]:
    return list(with_train_length(eval_config(run_cfg.eval), run_cfg.train.seq_len).lengths)


def evaluator_record(path: str) -> dict:
    """The results.json of a finished run at `path`, refused in one line otherwise."""
    what = f"eval.longppl.evaluator={path!r} is not accepted"
    run_dir = Path(path)
    try:
        record = json.loads((run_dir / "results.json").read_text())
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or record.get("status") != "ok" \
            or not (run_dir / "checkpoint.pt").is_file():
        raise ConfigError(f"{what}: it holds no finished run (a results.json with status ok and "
                          "its checkpoint.pt); expected the run dir of a finished `posbench "
                          "train`, or null for the run itself")
    return record


def _tokenizer_of(dataset: dict) -> tuple:
    return dataset.get("tokenizer", "byte"), bool(dataset.get("bos", False))


def require_same_corpus(record: dict, path: str, name: str, fingerprint: Optional[str],
                        tokenizer: tuple) -> None:
    """Refuses an evaluator trained on another corpus or tokenizer than the run (fingerprint
    None: not known yet, only the names are compared)."""
    theirs = record.get("config", {}).get("dataset", {})
    their_fp = record.get("dataset", {}).get("fingerprint")
    if theirs.get("name") != name or _tokenizer_of(theirs) != tokenizer or (
            fingerprint is not None and their_fp != fingerprint):
        tok, bos = _tokenizer_of(theirs)
        raise ConfigError(
            f"eval.longppl.evaluator={path!r} is not accepted: it was trained on dataset "
            f"{theirs.get('name')} (tokenizer {tok}, bos {bos}, fingerprint {their_fp}), this run "
            f"on {name} (tokenizer {tokenizer[0]}, bos {tokenizer[1]}"
            + (f", fingerprint {fingerprint}" if fingerprint else "")
            + "); expected an evaluator of the same corpus and tokenizer")


def window_rows(plan: EvalPlan) -> torch.Tensor:
    """All the windows of a plan (count, length+1), int64 on the CPU: a few bytes per scored
    token."""
    rows, answers = plan.rows(0, plan.count)
    assert answers is None, "eval.longppl scores text windows, not task answers"
    return torch.from_numpy(np.asarray(rows).astype(np.int64))


@torch.no_grad()
def long_losses(model, rows: torch.Tensor, batch_tokens: int, device) -> torch.Tensor:
    """(count, n) per-target loss with the whole window as context, batched as the perplexity
    protocol batches (float64, CPU)."""
    n = rows.shape[1] - 1
    per_batch = max(1, batch_tokens // n)
    out = []
    for i in range(0, len(rows), per_batch):
        batch = rows[i:i + per_batch].to(device)
        out.append(model.token_losses(batch[:, :-1], batch[:, 1:]).double().cpu())
    return torch.cat(out)


def lowest_eligible(first: int, trunc: int, block: int) -> int:
    """The first position whose target has a short context shorter than its long one: block 0
    starts at the window's start (its short contexts are the long ones), block 1 at `block`."""
    return max(trunc + block - 1, first)


def short_blocks(n: int, first: int, trunc: int, block: int) -> Dict[int, List[int]]:
    """The short-context forwards of a window of n targets, by input length: block k >= 1 runs
    on the window's tokens [k*block, k*block + trunc + block - 1) (fewer at the window's end)
    and gives the targets of positions k*block + trunc - 1 on, up to `block` of them. Only blocks
    holding a scored target run."""
    lowest = lowest_eligible(first, trunc, block)
    groups: Dict[int, List[int]] = {}
    for k in range(1, (n - trunc) // block + 1):
        start = k * block
        last = min(start + trunc + block - 2, n - 1)
        if last >= lowest:
            groups.setdefault(last + 1 - start, []).append(k)
    return groups


@torch.no_grad()
def short_losses(model, rows: torch.Tensor, first: int, trunc: int, block: int,
                 bos: Optional[int], batch_tokens: int, device) -> torch.Tensor:
    """(count, n) per-target loss with only the short context: NaN where the target is not
    eligible (its short context is its whole window's prefix, or it is not scored)."""
    count, n = rows.shape[0], rows.shape[1] - 1
    out = torch.full((count, n), math.nan, dtype=torch.float64)
    lowest = lowest_eligible(first, trunc, block)
    for m, ks in short_blocks(n, first, trunc, block).items():
        starts = torch.tensor(ks, dtype=torch.int64) * block
        span = torch.arange(m + 1)
        items = count * len(ks)
        per_batch = max(1, batch_tokens // m)
        for i in range(0, items, per_batch):
            item = torch.arange(i, min(i + per_batch, items))
            row, start = item // len(ks), starts[item % len(ks)]
            windows = rows[row.view(-1, 1), start.view(-1, 1) + span].to(device)
            x = windows[:, :-1].clone()
            if bos is not None:
                x[:, 0] = bos
            h = model.hidden(x)[:, trunc - 1:].flatten(0, 1)
            y = windows[:, trunc:].flatten()
            loss = torch.cat([F.cross_entropy(model.head(h[s:s + HEAD_CHUNK]).float(),
                                              y[s:s + HEAD_CHUNK], reduction="none")
                              for s in range(0, len(y), HEAD_CHUNK)]).double().cpu()
            positions = start.view(-1, 1) + torch.arange(trunc - 1, m)
            rows_of = row.view(-1, 1).expand_as(positions)
            out[rows_of.flatten(), positions.flatten()] = loss
    out[:, :lowest] = math.nan
    return out


def key_tokens(long: torch.Tensor, short: torch.Tensor, alpha: float, beta: float):
    """The key-token mask: loss_short - loss_long > alpha and loss_long < beta (NaN: never)."""
    return ((short - long) > alpha) & (long < beta)


def length_point(first: int, lowest: int, losses: torch.Tensor, keys: torch.Tensor) -> dict:
    """One length's entry of results.json's eval.longppl.by_length, from the evaluated run's
    long-context losses (count, n) and the key-token mask."""
    count, n = losses.shape
    found = int(keys.sum())
    loss = losses[keys].mean().item() if found else None
    scored = count * (n - first)
    return {"length": n, "tokens": scored, "eligible": count * max(0, n - lowest),
            "key_tokens": found, "fraction": found / scored,
            "loss": loss, "longppl": math.exp(loss) if found else None,
            "ppl": math.exp(losses[:, first:].mean().item())}


def score_length(model, plan: EvalPlan, trunc: int, block: int, batch_tokens: int, device,
                 choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> dict:
    """LongPPL at one length: choose(rows, long) gives the key-token mask of the windows (`long`:
    `model`'s long-context losses), and `model`'s long-context losses on them are scored."""
    rows = window_rows(plan)
    long = long_losses(model, rows, batch_tokens, device)
    return length_point(plan.first, lowest_eligible(plan.first, trunc, block), long,
                        choose(rows, long))


def options_by_value(eval_cfg) -> dict:
    """eval_options, a LongRoPE factors file (eval.longrope_factors) by its contents' sha256:
    what the file holds changes the losses, not where it is."""
    options = eval_options(eval_cfg)
    if options["longrope_factors"] is not None:
        options["longrope_factors"] = file_digest(Path(options["longrope_factors"])).hex()
    return options


def choose_keys(judge, rows: torch.Tensor, first: int, cfg: LongPPLConfig, trunc: int,
                bos: Optional[int], batch_tokens: int, device,
                long: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The (count, n) key-token mask of windows `rows` as `judge` chooses them (`long`: its
    long-context losses when already computed)."""
    if long is None:
        long = long_losses(judge, rows, batch_tokens, device)
    short = short_losses(judge, rows, first, trunc, block=cfg.block, bos=bos,
                         batch_tokens=batch_tokens, device=device)
    return key_tokens(long, short, cfg.alpha, cfg.beta)


@register("longppl", "perplexity on the key tokens only, those whose loss long context lowers "
          "by > alpha nats (LongPPL), chosen by the run or an evaluator run")
class LongPPL(Section):
    Config = LongPPLConfig

    @classmethod
    def check(cls, cfg: LongPPLConfig, run_cfg) -> None:
        """Its keys, whether enabled or not; the evaluator run only when enabled."""
        for key in ("alpha", "beta"):
            value = getattr(cfg, key)
            require(isinstance(value, (int, float)) and math.isfinite(value)
                    and (value >= 0 if key == "alpha" else value > 0),
                    f"eval.longppl.{key}", value,
                    "a finite number of nats >= 0" if key == "alpha"
                    else "a finite number of nats > 0")
        longest = max(eval_lengths(run_cfg))
        if cfg.trunc_len is not None:
            require(isinstance(cfg.trunc_len, int) and 1 <= cfg.trunc_len < longest,
                    "eval.longppl.trunc_len", cfg.trunc_len,
                    f"an integer >= 1 below the longest evaluated length {longest}, or null "
                    "(the training length)")
        elif cfg.enabled and run_cfg.train.seq_len >= longest:
            raise ConfigError(f"eval.longppl.trunc_len=null is not accepted with eval.lengths up "
                              f"to {longest}: null is the training length "
                              f"{run_cfg.train.seq_len}, and no target has more context than "
                              f"that; expected an integer >= 1 below {longest}, or a longer "
                              "eval length")
        require(isinstance(cfg.block, int) and cfg.block >= 1, "eval.longppl.block", cfg.block,
                "a positive integer (targets sharing one short-context forward)")
        if not cfg.enabled:
            return
        text = dataset_class(run_cfg.dataset).text
        require(text, "eval.longppl.enabled", cfg.enabled,
                f"false for dataset={run_cfg.dataset.name} (its windows are scored on the "
                "answers only)")
        if cfg.evaluator is not None:
            record = evaluator_record(cfg.evaluator)
            require_same_corpus(record, cfg.evaluator, run_cfg.dataset.name, None,
                                _tokenizer_of(run_cfg.dataset))

    def __init__(self, cfg, run_cfg, data):
        super().__init__(cfg, run_cfg, data)
        self.eval_cfg = with_train_length(eval_config(run_cfg.eval), run_cfg.train.seq_len)
        # the protocol's own windows, rebuilt: deterministic, so the same tokens it scores
        self.plans = plans(data, self.eval_cfg)
        self.trunc = trunc_length(cfg, run_cfg)
        self.keys_from: Optional[str] = None  # where a length's evaluator key tokens came from
        if cfg.evaluator is not None:  # its corpus against this run's, before any work
            require_same_corpus(evaluator_record(cfg.evaluator), cfg.evaluator, data.name,
                                data.fingerprint, _tokenizer_of(run_cfg.dataset))

    def judge(self, model, device):
        """The evaluator's model, the eval node of its config (its own eval-time options) and
        its checkpoint's sha256; the run's model and None twice when evaluator is null."""
        if self.cfg.evaluator is None:
            return model, None, None
        loaded = self.load_trained(Path(self.cfg.evaluator), device)
        theirs, ours = loaded.model.head.out_features, model.head.out_features
        if theirs != ours:
            raise ConfigError(f"eval.longppl.evaluator={self.cfg.evaluator!r} is not accepted: "
                              f"its vocabulary has {theirs} tokens, this run's {ours}; expected "
                              "an evaluator of the same tokenizer")
        return loaded.model, loaded.config.eval, file_digest(loaded.checkpoint).hex()

    def keys(self, judge, identity: Optional[dict], rows: torch.Tensor, first: int,
             long: torch.Tensor, device) -> torch.Tensor:
        """The key-token mask of windows `rows`: the run's own (identity None: judge is the
        run's model, `long` its losses), or the evaluator's, read from its cache under
        `identity` and these windows or computed and stored (longppl_cache.py). self.keys_from
        says which, for the log."""
        cfg, batch_tokens = self.cfg, self.eval_cfg.batch_tokens
        bos = getattr(self.data, "bos", None)
        if identity is None:
            return choose_keys(judge, rows, first, cfg, self.trunc, bos, batch_tokens, device,
                               long=long)
        key = {**identity, "length": rows.shape[1] - 1, "first": first,
               "windows": windows_digest(rows)}
        mask, self.keys_from = cached_keys(
            Path(cfg.evaluator) / FOLDER, key, tuple(long.shape),
            lambda: choose_keys(judge, rows, first, cfg, self.trunc, bos, batch_tokens, device))
        return mask

    @torch.no_grad()
    def run(self, model, device: torch.device) -> dict:
        cfg, trunc = self.cfg, self.trunc
        judge, judge_eval, digest = self.judge(model, device)
        model.eval()
        # the evaluator's key tokens are cached under all that decides them (longppl_cache.py)
        identity = None
        if cfg.evaluator is not None:
            set_eval_options(judge, judge_eval)  # a factors file it cannot read: refused first
            identity = {"evaluator": digest, "evaluator_eval": options_by_value(judge_eval),
                        "corpus": self.data.fingerprint, "trunc_len": trunc, "block": cfg.block,
                        "alpha": cfg.alpha, "beta": cfg.beta,
                        "batch_tokens": self.eval_cfg.batch_tokens, "device": device.type}
        points = []
        bar = Bar("longppl", len(self.plans), "length")
        for plan in self.plans:
            # every length from fresh eval-time options: encoding=randomized draws the same
            # positions for window i of length n as the perplexity pass does
            set_eval_options(model, self.run_cfg.eval)
            if judge is not model:
                set_eval_options(judge, judge_eval)
            self.keys_from = None
            points.append(scored_within_memory(
                device, lambda: score_length(
                    model, plan, trunc, cfg.block, self.eval_cfg.batch_tokens, device,
                    lambda rows, long: self.keys(judge, identity, rows, plan.first, long,
                                                 device)),
                length=plan.length))
            bar.update()
            p = points[-1]
            bar.log(f"length {plan.length} ({bar.n}/{bar.total})"
                    + (f" key tokens {self.keys_from}" if self.keys_from else ""),
                    **({"status": p["status"]} if "status" in p else {
                        "ppl": f"{p['ppl']:.3f}",
                        "longppl": "null" if p["longppl"] is None else f"{p['longppl']:.3f}",
                        "key_tokens": p["key_tokens"]}))
        bar.close()
        set_eval_options(model, self.run_cfg.eval)
        return {"units": "nats", "alpha": cfg.alpha, "beta": cfg.beta, "trunc_len": trunc,
                "block": cfg.block, "evaluator": cfg.evaluator, "by_length": points}

    @classmethod
    def write(cls, result: dict, train_len: int, run_dir, stem: str, title: str) -> None:
        """longppl_vs_length.png: LongPPL beside perplexity on the same tokens."""
        series = {"ppl (every scored token)": [(p["length"], p["ppl"], None)
                                               for p in result["by_length"] if p.get("ppl")],
                  "LongPPL (key tokens)": [(p["length"], p["longppl"], None)
                                           for p in result["by_length"]
                                           if p.get("longppl") is not None]}
        plot_curves(series, train_len, Path(run_dir) / f"longppl_vs_length{stem}.png",
                    title=f"{title}\nkey tokens: {chooser(result)}, trunc_len "
                          f"{result['trunc_len']}, alpha {result['alpha']:g}, beta "
                          f"{result['beta']:g}")

    @classmethod
    def report_lines(cls, runs: List[dict], labels: dict) -> List[str]:
        return report_lines(runs, labels)

    @classmethod
    def length_metrics(cls, result: dict) -> Dict[int, dict]:
        return {p["length"]: {"eval/longppl": p["longppl"], "eval/longppl_key_tokens":
                              p["key_tokens"], "eval/longppl_fraction": p["fraction"]}
                for p in result["by_length"] if "key_tokens" in p}


def chooser(result: dict) -> str:
    return "the run itself" if result.get("evaluator") is None else result["evaluator"]


def settings(result: dict) -> str:
    """How a run's key tokens were chosen: by which run, with which short contexts and bounds
    (runs that differ here were scored on different tokens)."""
    return (f"by {chooser(result)}, trunc_len={result['trunc_len']}, "
            f"block={result.get('block', 1)}, alpha={result['alpha']:g}, beta={result['beta']:g}")


def _cell(p: Optional[dict]) -> str:
    if p is None:
        return "—"
    if "status" in p:
        return p["status"]
    longppl = "null" if p["longppl"] is None else f"{p['longppl']:.3f}"
    return f"{p['ppl']:.3f} / {longppl} ({p['key_tokens']})"


def report_lines(runs: List[dict], labels: dict) -> List[str]:
    """A table of ppl / LongPPL (key tokens) by length, one row per run that scored it."""
    scored = [(labels[i], run["eval"]["longppl"]) for i, run in enumerate(runs)
              if run["eval"].get("longppl")]
    if not scored:
        return []
    lengths = sorted({p["length"] for _, r in scored for p in r["by_length"]})
    hows = {settings(r) for _, r in scored}
    one = len(hows) == 1  # else each row says how its key tokens were chosen
    lines = ["", "LongPPL: perplexity / perplexity on the key tokens only (their count), by "
             "length; key tokens: a loss lower by > alpha nats with the whole window than with "
             "a short context of the last trunc_len tokens (`block` targets sharing one), and "
             "below beta nats, chosen " + (f"{next(iter(hows))}." if one else
                                           "as each run's last column says."), "",
             "| run | " + " | ".join(map(str, lengths)) + " |" + ("" if one else " key tokens |"),
             "|---|" + "---:|" * len(lengths) + ("" if one else "---|")]
    for label, r in scored:
        found = {p["length"]: p for p in r["by_length"]}
        lines.append(f"| {label} | " + " | ".join(_cell(found.get(n)) for n in lengths) + " |"
                     + ("" if one else f" {settings(r)} |"))
    return lines
