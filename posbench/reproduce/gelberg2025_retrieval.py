"""Gelberg, Eguchi, Akiba and Cetin 2025 (DroPE), Table 1: zero-shot success rate at twice the
training context on RULER's multi-query (MQ), multi-key (MK) and multi-value (MV) needle tasks,
RoPE scored as trained and with PI, NTK and YaRN, against ALiBi, NoPE, RNoPE-SWA and DroPE.
Reduced to posbench's default CPU setting with QK-norm in every row:
posbench/conf/experiment/gelberg2025_retrieval.yaml, its rows posbench/conf/gelberg2025_retrieval.
The QK-norm is posbench's choice: the paper's from-scratch models (Tables 1 and 6) have none (its
Table 4), and it adds QK-norm for its SmolLM runs only.

The paper's models are trained on text and scored zero-shot; a tiny model trained on text alone
scores 0 on RULER at any length (docs/results.md, "RULER's formats in training"), so half of the
training rows here are instances of RULER's ten default tasks at L (train.ruler_mix=0.5), for
12000 steps: the budget at which the tiny RoPE model learns the three (trained on the three
alone it had not by step 6000, nor by 4000 of 12000, while the ten's easier tasks lead it there
by step 4000; docs/results.md). The 2L scores are then zero-shot in length only. The paper's
MK is four (key, value) needles in an essay haystack, one key asked (its Appendix C.2): RULER's
niah_multikey_1 (4 needles of distinct word keys in essay text, one asked), the variant whose
only change from a single needle is the other keys (_2 and _3 are haystacks made of needles).
A retrieval score at 2L says nothing about length for a row that cannot retrieve at L: every
claim first checks the score at L (claims.AheadAt, AccuracyIn). The score is RULER's
own, the share of the asked values found (eval.ruler's recall, RULER's string_match_all): MK
has one value, MQ two and MV four, each credited when all its tokens are the model's argmax
given the true tokens before them. The three RoPE
scalings are not trained: each is RoPE's finished runs scored again with eval.rope_scaling
(`rescored`, posbench/reproduce/rescores.py)."""
from __future__ import annotations

from posbench.reproduce.base import Reproduction, Rescore, Sweep, register, ruler_scores
from posbench.reproduce.claims import AccuracyIn, AheadAt, Measured, score_name, task_group
from posbench.reproduce.judge import task_tables

# the paper's rows, in its order; the three scalings are RoPE's runs scored with eval.rope_scaling
# at the dynamic factor s = max(1, n/L): s = 2 at 2L, RoPE's own model at L
ROWS = ("rope", "rope_pi", "rope_ntk", "rope_yarn", "alibi", "nope", "rnope_swa", "drope")
SCALINGS = {"rope_pi": "pi", "rope_ntk": "ntk", "rope_yarn": "yarn"}
NAMES = {"rope": "RoPE", "rope_pi": "RoPE + PI", "rope_ntk": "RoPE + NTK",
         "rope_yarn": "RoPE + YaRN", "alibi": "ALiBi", "nope": "NoPE", "rnope_swa": "RNoPE-SWA",
         "drope": "DroPE"}
TASKS = ("niah_multiquery", "niah_multikey_1", "niah_multivalue")
COLUMNS = {"niah_multiquery": "MQ", "niah_multikey_1": "MK", "niah_multivalue": "MV"}
DROP = 0.875  # train.switch_encoding_at of the drope row: the paper's late drop (14K of 16K)
SCORE = "recall"  # RULER's string_match_all (posbench/evaluations/ruler.py)
LEARNED = 0.5  # score at L below which a row has not learned a task
AT_2L = 2.0

BAND_WHY = ("each rate is over 5 depths x 100 trials = 500 instances per task and length, the "
            "paper's 500: a binomial standard error of at most 0.022 (at 0.5; 0.018 at 0.2, "
            "where most of the paper's rates lie), 0.032 for a difference of two rows, whose 95% "
            "interval is ±0.062 at 0.5 and ±0.050 at 0.2; every row scores the same instances "
            "(one generator per seed, task, length, depth and trial), so a difference is paired "
            "and its noise less in fact: 0.05, to which the seeds' own 95% bands are added; "
            "the paper's gaps in the claims of one row above others are 0.019 to 0.36 (the "
            "smallest, DroPE's 23.3 against NoPE's 21.4 on MV, is inside the band)")
FAIL_WHY = ("500 instances per task and length: a row that completes none of them (the paper's "
            "0) reads 0.000, and one that completes 1% reads under 0.02 nearly always; 0.05 "
            "admits a few percent, the noise of a model at the edge of its training length, "
            "and refuses a row that retrieves at 2L as often as the paper's NTK row (0.165 and "
            "more)")
LEARNED_NOTE = (f"a row under {LEARNED:g} at L on a task has not learned it, and its "
                "2L score says nothing about length: such a claim is not comparable (a rival "
                "under it is left out and named)")


def each(rows) -> tuple:
    return tuple(task_group(t, r) for t in TASKS for r in rows)


@register("gelberg2025_retrieval", "DroPE Table 1: RULER multi-query, multi-key, multi-value "
          "at 2L, RoPE (+PI/NTK/YaRN), ALiBi, NoPE, RNoPE-SWA, DroPE (CPU)")
class Gelberg2025Retrieval(Reproduction):
    paper = ("Gelberg, Eguchi, Akiba & Cetin 2025, Extending the Context of Pretrained LLMs by "
             "Dropping Their Positional Embeddings (DroPE), arXiv 2512.12167")
    where = "Table 1"
    setting = ("tiny model (0.8M) with QK-norm (the paper's has none), byte-level pystdlib, "
               "L = 128, 12000 steps of 16 with half the rows RULER instances of its ten "
               "default tasks (train.ruler_mix=0.5), RoPE dropped at step 10500 for DroPE, "
               "RULER's score (the share of the asked values found) at L and 2L over 500 "
               "instances per task, 3 seeds")
    device = "cpu"
    reduction = ("the model (0.8M parameters against a ~0.5B Qwen2-shaped model), the corpus "
                 "(pystdlib bytes against FineWeb), L (128 against 1024), the budget (24.6M "
                 "tokens, half of them task instances, against 16B), the training (RULER's "
                 "formats are trained at L, where the paper's models see text only, so "
                 "the 2L scores are zero-shot in length only), the tasks (RULER's formats at "
                 "posbench's scale: keys of 3 bytes, numbers of 4, 2 queries for MQ against "
                 "RULER's 4, which do not fit 128 bytes; posbench/evaluations/ruler.py) and the "
                 "scoring (each value's tokens teacher-forced argmax against greedy "
                 "generation); absolute success rates are not comparable, the claims read "
                 "failures, orders and gaps")
    axis = "score"
    metric = "accuracy"
    paper_train_length = 1024
    sweep = Sweep(experiment="gelberg2025_retrieval")
    groups = each(ROWS)
    rescored = {row: Rescore("rope", (f"eval.rope_scaling={scaling}",))
                for row, scaling in SCALINGS.items()}
    # success rate (%) at 2x the training context, as the table prints it
    published = {"rope": {"MQ": 0.0, "MK": 0.0, "MV": 0.0},
                 "rope_pi": {"MQ": 0.0, "MK": 0.0, "MV": 0.0},
                 "rope_ntk": {"MQ": 21.1, "MK": 19.4, "MV": 16.5},
                 "rope_yarn": {"MQ": 17.8, "MK": 0.5, "MV": 14.6},
                 "alibi": {"MQ": 5.2, "MK": 0.0, "MV": 1.1},
                 "nope": {"MQ": 9.2, "MK": 36.2, "MV": 21.4},
                 "rnope_swa": {"MQ": 5.2, "MK": 25.6, "MV": 20.6},
                 "drope": {"MQ": 28.0, "MK": 41.6, "MV": 23.3}}
    source = ("Gelberg et al. 2025, arXiv 2512.12167, Table 1 (zero-shot success rate, %, at "
              "2x the training context over 500 trials; ~0.5B Qwen2-shaped models, 16B FineWeb "
              "tokens, L = 1024). DroPE is the 14B-token RoPE checkpoint with RoPE dropped and "
              "trained on for the final 2B tokens (section 5.1); MK is four (key, value) "
              "needles in Paul Graham's essays, one key asked, and the scalings' factor is set "
              "to the extension, s = 2 at 2x (Appendix C.2); the authors' repository (GitHub "
              "SakanaAI/DroPE) holds training code and no evaluation")
    claims = (
        AccuracyIn("rope_fails_at_2L", "RoPE completes no answer at 2L on any of the three "
                   "tasks (0, 0, 0)", 0.05, f"{FAIL_WHY}; {LEARNED_NOTE}",
                   groups=each(("rope",)), low=AT_2L, high=AT_2L, most=0.0, learned=LEARNED),
        AccuracyIn("pi_fails_at_2L", "RoPE with PI completes no answer at 2L either (0, 0, 0)",
                   0.05, f"{FAIL_WHY}; {LEARNED_NOTE}",
                   groups=each(("rope_pi",)), low=AT_2L, high=AT_2L, most=0.0, learned=LEARNED),
        AheadAt("ntk_above_rope_and_pi", "NTK scaling retrieves at 2L where RoPE and PI do not: "
                "21.1, 19.4 and 16.5 against 0", 0.05, f"{BAND_WHY}; {LEARNED_NOTE}",
                group="rope_ntk", rivals=("rope", "rope_pi"), tasks=TASKS, learned=LEARNED),
        AheadAt("yarn_above_rope", "YaRN retrieves at 2L on MQ and MV where RoPE does not "
                "(17.8 and 14.6 against 0; on MK 0.5, not a claim)", 0.05,
                f"{BAND_WHY}; {LEARNED_NOTE}", group="rope_yarn", rivals=("rope",),
                tasks=("niah_multiquery", "niah_multivalue"), learned=LEARNED),
        AheadAt("nope_above_rope", "NoPE retrieves at 2L where RoPE does not: 9.2, 36.2 and "
                "21.4 against 0", 0.05, f"{BAND_WHY}; {LEARNED_NOTE}",
                group="nope", rivals=("rope",), tasks=TASKS, learned=LEARNED),
        AheadAt("rnope_swa_above_rope", "RNoPE-SWA retrieves at 2L on MK and MV where RoPE does "
                "not (25.6 and 20.6 against 0; on MQ 5.2, not a claim)", 0.05,
                f"{BAND_WHY}; {LEARNED_NOTE}", group="rnope_swa", rivals=("rope",),
                tasks=("niah_multikey_1", "niah_multivalue"), learned=LEARNED),
        AccuracyIn("alibi_fails_at_2L", "ALiBi barely retrieves at 2L: at most 5.2% on any "
                   "task (5.2, 0.0, 1.1)", 0.05, f"{FAIL_WHY}; {LEARNED_NOTE}",
                   groups=each(("alibi",)), low=AT_2L, high=AT_2L, most=0.052,
                   learned=LEARNED),
        AheadAt("drope_above_rope_scalings", "DroPE is above RoPE and every RoPE scaling on "
                "each task: 28.0, 41.6 and 23.3 against the best scaling's 21.1, 19.4 and "
                "16.5 (NTK)", 0.05, f"{BAND_WHY}; {LEARNED_NOTE}",
                group="drope", rivals=("rope", *SCALINGS), tasks=TASKS, learned=LEARNED),
        AheadAt("drope_best", "DroPE is the best of all eight rows on each task at 2L (28.0, "
                "41.6, 23.3; the next best NTK's 21.1, NoPE's 36.2 and 21.4): best or tied "
                "within the band", 0.05, f"{BAND_WHY}; {LEARNED_NOTE}",
                group="drope", rivals=tuple(r for r in ROWS if r != "drope"), tasks=TASKS,
                tie=True, learned=LEARNED),
    )
    cost = ("15 trainings (5 trained rows x 3 seeds) of 12000 steps of 16 x 128 tokens, half "
            "of the rows RULER instances, one per core, then 9 re-scores (rope_pi, rope_ntk, "
            "rope_yarn: each of RoPE's 3 runs scored with eval.rope_scaling=pi, ntk, yarn, "
            "`posbench eval RUN_DIR overrides`), one at a time. A training takes 45-60 minutes "
            "on one core of the 2-core x86-64 with other jobs running (RoPE's took 47.9, with "
            "a RULER scoring every 2000 steps); each re-score, like each training's own "
            "scoring, is one RULER scoring (3 tasks x 2 lengths x 500 instances, and as many "
            "with the needles removed), about a minute: 12-15 hours of core time, 6-8 hours on "
            "two cores, over several sittings; resumable, finished trainings and "
            "re-scores are skipped; `seed=0` or `gelberg2025_retrieval=rope,drope` runs a part")

    @classmethod
    def group_of(cls, record: dict) -> str:
        """The row a run is (each run scores all three tasks, so it is in a group `task/row` of
        each): DroPE by where its training dropped RoPE, a scaling by eval.rope_scaling (at the
        dynamic factor; a static one is named), else its encoding."""
        cfg = record["config"]
        at = cfg["train"].get("switch_encoding_at")
        if at is not None:
            return ("drope" if (record["encoding"], at) == ("rope", DROP)
                    else f"{record['encoding']}_dropped_at_{at:g}")
        scaling = cfg.get("eval", {}).get("rope_scaling", "none")
        if scaling != "none":
            factor = cfg["eval"].get("rope_scaling_factor")
            return f"{record['encoding']}_{scaling}" + ("" if factor is None else
                                                        f"_x{factor:g}")
        return record["encoding"]

    @classmethod
    def owns(cls, records):
        """The rows among the records that this entry does not compare."""
        return sorted({cls.group_of(r) for r in records} - set(ROWS))

    @classmethod
    def measure(cls, records) -> Measured:
        """Each task's score by length, per row: ruler_scores (base.py)."""
        return ruler_scores(records, cls.group_of, TASKS, SCORE)

    @classmethod
    def paper_measured(cls, at_l: float = 1.0) -> Measured:
        """Table 1 as Measured numbers at 2L (its rates over 100), each row at `at_l` at L (the
        paper does not print its rates at L; 1.0: every row learned every task)."""
        return Measured({task_group(t, r): {1.0: at_l, AT_2L: cls.published[r][c] / 100}
                         for t, c in COLUMNS.items() for r in ROWS}, at_paper_scale=True,
                        score=score_name(SCORE))

    @classmethod
    def tables(cls, measured, train_len):
        """Success rate (%) at 2L, the paper's beside posbench's (with its value at L, the check
        that the row learned the task), then each task's score by length."""
        lines = ["", "## Success rate (%) at 2L: the paper's and posbench's", "",
                 "posbench's is RULER's score (the share of the asked values found, each "
                 "value's tokens the model's argmax) at 2L = "
                 f"{2 * train_len}, the mean over seeds of 5 depths x 100 trials, and in "
                 f"brackets at L = {train_len} (under {LEARNED:g}: the row has not learned the "
                 "task, its 2L score says nothing about length); the paper's is at 2 x "
                 f"{cls.paper_train_length} over 500 trials.", "",
                 "| row | " + " | ".join(f"paper {c} | posbench {c}" for c in COLUMNS.values())
                 + " |", "|---|" + "---:|" * (2 * len(COLUMNS))]
        for row in ROWS:
            cells = []
            for task, column in COLUMNS.items():
                ours = measured.values.get(task_group(task, row), {})
                far, near = ours.get(AT_2L), ours.get(1.0)
                cells += [f"{cls.published[row][column]:.1f}",
                          "—" if far is None else f"{100 * far:.1f}"
                          + ("" if near is None else f" ({100 * near:.1f})")]
            lines.append(f"| {NAMES[row]} | " + " | ".join(cells) + " |")
        lines += task_tables(measured, TASKS, ROWS, "RULER's score by length", head="row")
        return lines
