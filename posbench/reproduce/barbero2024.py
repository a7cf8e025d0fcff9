"""Barbero, Vitvitskyi, Perivolaropoulos, Pascanu and Veličković 2024 (p-RoPE), Table 2: NoPE,
RoPE at two bases, p-RoPE at p = 0.25 and 0.75 and the two ablations of 0.75-RoPE, validation
perplexity at the training length; reduced to posbench's default CPU setting, where the rows
differ by less than 1% and a paired interval over the same windows and seeds decides what can be
told apart."""
from posbench.reproduce.base import Reproduction, Sweep, register
from posbench.reproduce.claims import PAIRED_WHY, Below

ROWS = ("nope", "rope_10k", "rope_500k", "p_rope_0.25", "p_rope_0.75", "reversed_0.75",
        "partial_0.75")  # posbench/conf/barbero2024/<row>.yaml
WHY = f"the paper's rows differ by 0.3-2% (it does not say over how many seeds); {PAIRED_WHY}"


@register("barbero2024", "p-RoPE Table 2: NoPE, RoPE 10k/500k, 0.25/0.75-p-RoPE, ablations (CPU)")
class Barbero2024(Reproduction):
    paper = ("Barbero, Vitvitskyi, Perivolaropoulos, Pascanu & Veličković 2024, Round and Round "
             "We Go! What makes Rotary Positional Encodings useful?, arXiv 2410.06205")
    where = "Table 2"
    setting = ("tiny model (0.8M), byte-level pystdlib, the seven rows trained at L=128 for 2000 "
               "steps of 16, 3 seeds, perplexity at L (and at 4L, 8L, which the paper does not "
               "report)")
    device = "cpu"
    reduction = ("the model (0.8M parameters, head dimension 32, against Gemma 2B), the corpus "
                 "(pystdlib bytes against Wiki and FlanV2), L (128 against 8192) and the budget; "
                 "absolute perplexities are not comparable, the order of the rows is")
    axis = "length"
    paper_train_length = 8192
    sweep = Sweep(experiment="barbero2024")
    groups = ROWS
    published = {"nope": {8192: 4.8594}, "rope_10k": {8192: 4.4627},
                 "rope_500k": {8192: 4.4485}, "p_rope_0.25": {8192: 4.5302},
                 "p_rope_0.75": {8192: 4.4414}, "reversed_0.75": {8192: 4.4592},
                 "partial_0.75": {8192: 4.4537}}
    source = ("Barbero et al., ICLR 2025, arXiv 2410.06205, Table 2, the Wiki column (FlanV2: "
              "NoPE 6.6429, RoPE 10k 6.4429, 500k 6.4593, 0.75 reversed 6.4683, 0.75 partial "
              "6.4562, 0.25 6.5111, 0.75 6.4422: RoPE 10k moves from fifth to second and "
              "500k from second to fourth, so the base is not a claim here; the five claims "
              "hold on FlanV2 too); what 'reversed' and 'partial' are: docs/encodings.md, "
              "p_rope")
    claims = (
        Below("nope_behind", "NoPE is behind every rotary row; the nearest, 0.25-RoPE, by 7.3%",
              0.0, WHY, lower="p_rope_0.25", higher="nope"),
        Below("quarter_behind", "0.25-RoPE is behind 0.75-RoPE (4.5302 against 4.4414, +2.0%)",
              0.0, WHY, lower="p_rope_0.75", higher="p_rope_0.25"),
        Below("prope_ahead_of_rope", "0.75-RoPE is ahead of RoPE (4.4414 against 4.4627, "
              "+0.48%)", 0.0, WHY, lower="p_rope_0.75", higher="rope_10k"),
        Below("reversed_behind", "dropping the fastest pairs instead of the slowest is worse "
              "(0.75 reversed 4.4592, +0.40%)", 0.0, WHY, lower="p_rope_0.75",
              higher="reversed_0.75"),
        Below("partial_behind", "NeoX-style partial rotary at 0.75 is worse (4.4537, +0.28%)",
              0.0, WHY, lower="p_rope_0.75", higher="partial_0.75"),
    )
    cost = ("21 jobs (7 rows x 3 seeds) of 2000 steps of 16 x 128 tokens, two at a time: each "
            "about 6 minutes on one core of an idle 2-core x86-64 (README: one default run), "
            "about 65 minutes in all; resumable, finished jobs are skipped")

    @classmethod
    def group_of(cls, record: dict) -> str:
        """The row a run is: its encoding with its base, p and variant."""
        enc = record["config"]["encoding"]
        if enc["name"] == "rope":
            return f"rope_{enc['base'] / 1000:g}k"
        if enc["name"] == "p_rope":
            variant = enc.get("variant", "p_rope")
            return f"{variant}_{enc['p']:g}"
        return enc["name"]
