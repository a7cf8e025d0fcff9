"""`posbench longrope RUN_DIR --length N`: LongRoPE's evolutionary search (Ding et al. 2024, arXiv
2402.13753, Section 3.2; microsoft/LongRoPE evolution/) for one rescale factor per rotary pair
that minimises a finished run's perplexity at a length N above its training length L, written to
RUN_DIR/longrope-<N>-seed<S>.json for `posbench eval RUN_DIR eval.rope_scaling=longrope
eval.longrope_factors=...` (posbench/encodings/longrope.py applies them).

The search, as the reference's `dim_mono` algorithm runs it (evolution/algorithms/): factors on
a grid of STEP from 1 to 1 + s (s = N/L), non-decreasing from the fastest pair to the slowest;
an initial population of PI's, NTK's and YaRN's factors (the paper's; the released code starts
from YaRN's alone) and mutations of them; then each iteration keeps the `parents` best
candidates and adds `mutations` mutated and `crossovers` crossed ones. Every candidate is scored
by perplexity on validation windows of N tokens that share no token with the windows the run's
own perplexity curve scores. The sizes are the reference's times `scale` (its evo_scale).

The file is rewritten, atomically, after the initial population and after every iteration:
started again with the same settings, the search goes on from the last iteration it finished
(each iteration draws from a generator of (seed, iteration), so the result is that of an
uninterrupted search); a finished search is not run again, and a file of other settings is
refused, never overwritten."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from omegaconf import OmegaConf

from posbench.core.device import autocast, resolve_device
from posbench.core.errors import ConfigError
from posbench.core.io import write_json
from posbench.core.progress import Bar
from posbench.data import dataset_class, prepare
from posbench.data.windows import EvalPlan, share_tokens, with_bos
from posbench.encodings.base import EVAL_OPTIONS, encoding_class
from posbench.encodings.longrope import LongRoPE
from posbench.encodings.rope import RoPE, ntk_base, rope_inv_freq, yarn_inv_freq
from posbench.evaluations.base import eval_config, set_eval_options, with_train_length
from posbench.evaluations.perplexity import plans, score_plan
from posbench.runs.run import finished_results, trained_model

# evolution/default_hyper_params/dim_mono.json: the reference's sizes at evo_scale 1
REFERENCE_SIZES = {"population": 64, "iterations": 40, "mutations": 16, "crossovers": 16,
                   "parents": 32, "crossover_tries": 20}
STEP = 0.01  # list_step: the grid of factor values
P_PAIR = 0.3  # dim_mono.py: the chance that a pair is mutated, or offered to a crossover
P_TAKE = 0.5  # dim_mono.py: the chance that an offered pair takes the second parent's factor
# a CPU's default scale: 16 candidates at first, then 10 iterations of 8 (96 scored in all)
CPU_SCALE = 0.25
# the smallest scale that keeps two parents to cross and one iteration
MIN_SCALE = 1 / 16
FORMAT = 1


def sizes(scale: float) -> Dict[str, int]:
    """The reference's sizes times `scale`, rounded down as its GeneticAlgorithm does."""
    return {key: int(scale * value) for key, value in REFERENCE_SIZES.items()}


def search_path(run_dir: Path, length: int, seed: int) -> Path:
    return Path(run_dir) / f"longrope-{length}-seed{seed}.json"


def initial_factors(head_dim: int, base: float, train_len: int, s: float) -> Dict[str, np.ndarray]:
    """PI's, NTK's and YaRN's frequencies at scale s as factors lambda = theta / theta'
    (theta = base^(-2i/d), each pair's whether it rotates or not): PI s everywhere, NTK
    s^(2i/(d-2)), YaRN 1 on its kept pairs, s past its ramp."""
    theta = rope_inv_freq(head_dim, base)
    ntk = rope_inv_freq(head_dim, ntk_base(base, s, head_dim))
    yarn = yarn_inv_freq(theta, s, head_dim, base, train_len)
    return {"pi": np.full(head_dim // 2, float(s)), "ntk": (theta / ntk).numpy(),
            "yarn": (theta / yarn).numpy()}


def key(factors: np.ndarray) -> tuple:
    """A candidate's identity: its factors to 1e-9 (the reference compares with np.allclose)."""
    return tuple(np.round(factors, 9).tolist())


def monotone(factors: np.ndarray) -> bool:
    return bool(np.all(np.diff(factors) >= 0))


def mutate(parent: np.ndarray, top: float, rng: np.random.Generator, tried: set) -> np.ndarray:
    """dim_mono's mutation: each pair, with probability P_PAIR, takes a grid value between its
    neighbours' factors (1 below the first pair, `top` above the last), so the factors stay
    non-decreasing; repeated, on the same child, until it is a candidate not yet scored."""
    child = parent.copy()
    while True:
        for i in range(len(child)):
            if rng.random() < P_PAIR:
                low = child[i - 1] if i else 1.0
                high = child[i + 1] if i + 1 < len(child) else top
                steps = int(math.floor((high - low) / STEP + 1e-9))
                child[i] = min(low + STEP * int(rng.integers(0, steps + 1)), high)
        if key(child) not in tried:
            return child


def crossover(first: np.ndarray, second: np.ndarray, tries: int, rng: np.random.Generator,
              tried: set) -> Optional[np.ndarray]:
    """dim_mono's crossover: from the first parent, each pair offered with probability P_PAIR
    takes the second parent's factor with probability P_TAKE; the first child after an offer
    that is non-decreasing and not yet scored, within `tries` passes; None for equal parents or
    when none came."""
    if np.allclose(first, second):
        return None
    child = first.copy()
    for _ in range(tries):
        for i in range(len(child)):
            if rng.random() < P_PAIR:
                if rng.random() < P_TAKE:
                    child[i] = second[i]
                if monotone(child) and key(child) not in tried:
                    return child
    return None


class Search:
    """One search's state: every candidate scored (`tried`, factors and ppl in order), the
    population, the best ppl after each iteration (`history`), and how it scores a candidate."""

    def __init__(self, model, rope: RoPE, plan: EvalPlan, eval_cfg, device, length: int,
                 seed: int, scale: float):
        self.model, self.plan, self.device = model, plan, device
        self.eval_cfg = eval_cfg
        self.length, self.seed, self.sizes = length, seed, sizes(scale)
        self.train_len = rope.dims.scaling_len
        self.s = length / self.train_len
        self.top = 1 + self.s  # dim_mono.py: the grid ends at 1 + s
        self.starts = initial_factors(rope.dims.head_dim, rope.cfg.base, self.train_len, self.s)
        self.tried: List[Tuple[List[float], float]] = []
        self.seen: set = set()
        self.population: List[Tuple[np.ndarray, float]] = []
        self.history: List[dict] = []
        self.bar: Optional[Bar] = None

    def ppl(self, factors: np.ndarray) -> float:
        """Perplexity of the search windows with these factors (and the run's other eval
        options), every target scored."""
        options = {key: self.eval_cfg[key] for key in EVAL_OPTIONS}
        options.update(rope_scaling="longrope",
                       longrope_factors=LongRoPE.at(factors, self.length, self.train_len))
        self.model.encoding.set_eval_options(**options)
        with torch.no_grad(), autocast(self.device):
            return score_plan(self.model, self.plan, self.eval_cfg.batch_tokens,
                              self.device)["ppl"]

    def add(self, factors: np.ndarray) -> Tuple[np.ndarray, float]:
        ppl = self.ppl(factors)
        self.tried.append((factors.tolist(), ppl))
        self.seen.add(key(factors))
        best = min(p for _, p in self.tried)
        self.bar.update()
        self.bar.log(f"candidate {self.bar.n}/{self.bar.total}", ppl=f"{ppl:.4f}",
                     best=f"{best:.4f}")
        return factors, ppl

    def initial(self) -> None:
        """PI, NTK and YaRN, then mutations of them, to the population's size."""
        rng = np.random.default_rng([self.seed, 0])
        self.population = [self.add(f) for f in self.starts.values()]
        names = list(self.starts.values())
        while len(self.population) < self.sizes["population"]:
            parent = names[int(rng.integers(len(names)))]
            self.population.append(self.add(mutate(parent, self.top, rng, self.seen)))
        self.history.append({"iteration": 0, "best_ppl": self.best()[1],
                             "candidates": len(self.tried)})

    def iterate(self, iteration: int) -> None:
        """The `parents` best, then mutations of random parents and crossovers of random pairs
        (a crossover that finds no child mutates its first parent instead)."""
        rng = np.random.default_rng([self.seed, iteration])
        parents = sorted(self.population, key=lambda c: c[1])[:self.sizes["parents"]]
        population = list(parents)
        for _ in range(self.sizes["mutations"]):
            parent = parents[int(rng.integers(len(parents)))][0]
            population.append(self.add(mutate(parent, self.top, rng, self.seen)))
        for _ in range(self.sizes["crossovers"]):
            i, j = sorted(rng.choice(len(parents), 2, replace=False).tolist())
            child = crossover(parents[i][0], parents[j][0], self.sizes["crossover_tries"], rng,
                              self.seen)
            if child is None:
                child = mutate(parents[i][0], self.top, rng, self.seen)
            population.append(self.add(child))
        self.population = population
        self.history.append({"iteration": iteration, "best_ppl": self.best()[1],
                             "candidates": len(self.tried)})

    def best(self) -> Tuple[np.ndarray, float]:
        return min(self.population, key=lambda c: c[1])

    def state(self) -> dict:
        return {"population": [[f.tolist(), p] for f, p in self.population],
                "tried": [[f, p] for f, p in self.tried], "history": self.history}

    def restore(self, saved: dict) -> None:
        self.population = [(np.array(f, dtype=np.float64), p) for f, p in saved["population"]]
        self.tried = [(f, p) for f, p in saved["tried"]]
        self.seen = {key(np.array(f, dtype=np.float64)) for f, _ in self.tried}
        self.history = saved["history"]


def search_windows(data, run_cfg, length: int) -> EvalPlan:
    """ceil(eval.tokens / N) windows of N + 1 tokens (targets shifted by one), laid end to end in
    the validation documents as the nonoverlapping protocol lays them, among those that share
    no token with a window the run's perplexity curve scores, spread evenly over them."""
    eval_cfg = with_train_length(eval_config(run_cfg.eval), run_cfg.train.seq_len)
    span = length + 1
    candidates = np.concatenate([start + span * np.arange(n // span) for start, n in
                                 zip(data.val_docs[:-1], np.diff(data.val_docs))])
    scored = [(plan.starts, plan.length + 1) for plan in plans(data, eval_cfg)]
    free = candidates[~share_tokens(candidates, span, scored)]
    need = math.ceil(eval_cfg.tokens / length)
    if len(free) < need:
        raise ConfigError(f"--length {length} is not accepted: the validation documents of "
                          f"{data.name} hold {len(free)} windows of {span} tokens outside the "
                          f"windows the run's curve scores, {need} are needed (eval.tokens="
                          f"{eval_cfg.tokens}); expected a shorter length")
    chosen = free[np.linspace(0, len(free) - 1, need).round().astype(np.int64)]
    first = 0 if data.bos is None else 1  # the prediction made at BOS is not scored
    return EvalPlan(length, need, first, lambda i, j: (with_bos(
        np.stack([data.tokens[s:s + span] for s in chosen[i:j]]), data.bos), None), chosen)


def rotary_module(model) -> Optional[RoPE]:
    """The model's RoPE (its encoding, or the one a pattern or a wrapper holds): its head
    dimension, base and L seed the initial factors."""
    return next((m for m in model.modules() if isinstance(m, RoPE)), None)


def check_args(run_cfg, length: int, scale: float) -> None:
    """The refusals that need no data: a run that does not rotate q and k, a length not above L,
    a task, a scale below MIN_SCALE."""
    name = run_cfg.encoding.name
    if not encoding_class(run_cfg.encoding).rotary:
        raise ConfigError(f"encoding={name} is not accepted by posbench longrope; expected a run "
                          "whose encoding rotates q and k (LongRoPE rescales its frequencies)")
    L = run_cfg.train.get("original_len") or run_cfg.train.seq_len
    if length <= L:
        raise ConfigError(f"--length {length} is not accepted; expected a length above the "
                          f"training length {L} (the factors extend the run to it)")
    if not dataset_class(run_cfg.dataset).text:
        raise ConfigError(f"dataset={run_cfg.dataset.name} is not accepted by posbench longrope;"
                          " expected a text corpus (the search scores validation text windows)")
    if not scale >= MIN_SCALE:
        raise ConfigError(f"--scale {scale} is not accepted; expected a number >= {MIN_SCALE} "
                          "(the reference's sizes times it; below it no two parents are kept)")


def settings(run_dir: Path, run_cfg, length: int, seed: int, scale: float,
             plan: EvalPlan) -> dict:
    """What the file's search is: a file that says otherwise is another search."""
    return {"format": FORMAT, "run": str(Path(run_dir).resolve()),
            "train_len": run_cfg.train.get("original_len") or run_cfg.train.seq_len,
            "length": length, "seed": seed, "scale": scale, "sizes": sizes(scale),
            "windows": {"length": length, "starts": plan.starts.tolist()}}


def read_search(path: Path, wanted: dict) -> Optional[dict]:
    """The file's search when it is this one; None when there is none; refused when it holds
    another search or is unreadable."""
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is not accepted ({err}); expected a search written by "
                          "posbench longrope: delete it to search again") from None
    # where the run dir sits may change; what it holds may not
    differs = [k for k in wanted if k != "run" and saved.get(k) != wanted[k]]
    if differs:
        k = differs[0]
        raise ConfigError(f"{path} is not accepted: it holds a search with {k}="
                          f"{saved.get(k)!r}, not {wanted[k]!r}; expected the same settings, or "
                          "delete it to search again (nothing was overwritten)")
    return saved


def run_search(run_dir: Path, length: int, seed: int = 0, scale: float = CPU_SCALE) -> dict:
    """The search over run_dir's finished run; returns what its file holds."""
    run_dir = Path(run_dir)
    record = finished_results(run_dir)
    run_cfg = OmegaConf.create(record["config"])
    check_args(run_cfg, length, scale)
    device = resolve_device(run_cfg.device)
    trained = trained_model(run_dir, device)
    rope = rotary_module(trained.model)
    if rope is None:
        raise ConfigError(f"encoding={run_cfg.encoding.name} is not accepted by posbench "
                          "longrope; expected a run whose encoding rotates q and k by RoPE")
    data = prepare(run_cfg.dataset)
    trained.require_corpus(data)
    plan = search_windows(data, run_cfg, length)
    path = search_path(run_dir, length, seed)
    wanted = settings(run_dir, run_cfg, length, seed, scale, plan)
    saved = read_search(path, wanted)
    if saved and "factors" in saved:
        print(f"posbench: skipped: {path} holds this search, finished (best ppl "
              f"{saved['ppl']:.4f} at {length})")
        return saved
    # the run's eval options, but for its rotary scaling, which the candidates replace
    eval_cfg = eval_config(OmegaConf.merge(run_cfg.eval, {
        "rope_scaling": "none", "rope_scaling_factor": None, "rope_window": None,
        "rope_shift": None, "longrope_factors": None}))
    model = trained.model.to(device)
    set_eval_options(model, eval_cfg)
    search = Search(model, rope, plan, eval_cfg, device, length, seed, scale)
    n = search.sizes
    total = n["population"] + n["iterations"] * (n["mutations"] + n["crossovers"])
    if saved:
        search.restore(saved)
        print(f"posbench: resuming {path} after iteration {search.history[-1]['iteration']} of "
              f"{n['iterations']}")
    print(f"posbench: LongRoPE search of {run_dir} at {length} tokens (s = {search.s:g}), seed "
          f"{seed}, scale {scale:g}: {total} candidates on {plan.count} windows of {length} "
          f"tokens that the run's curve does not score; writing {path}", flush=True)
    search.bar = Bar("longrope", total, "candidate", initial=len(search.tried))
    if not saved:
        search.initial()
        write_json(path, {**wanted, **search.state()})
    for iteration in range(search.history[-1]["iteration"] + 1, n["iterations"] + 1):
        search.iterate(iteration)
        best = search.history[-1]["best_ppl"]
        search.bar.log(f"iteration {iteration}/{n['iterations']}", best=f"{best:.4f}")
        write_json(path, {**wanted, **search.state()})
    search.bar.close()
    factors, ppl = search.best()
    found = LongRoPE.at(factors, length, search.train_len)
    result = {**wanted, **found.record(), "ppl": ppl,
              "initial_ppl": {name: search.tried[i][1] for i, name in enumerate(search.starts)},
              **search.state()}
    write_json(path, result)
    print(f"posbench: best ppl {ppl:.4f} at {length} on the search windows (PI "
          f"{result['initial_ppl']['pi']:.4f}, NTK {result['initial_ppl']['ntk']:.4f}, YaRN "
          f"{result['initial_ppl']['yarn']:.4f}); wrote {path}\nposbench: score it with "
          f"`posbench eval {run_dir} eval.rope_scaling=longrope eval.longrope_factors={path}`")
    return result
