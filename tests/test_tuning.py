"""Learning rates tuned per group in the report (posbench/reports/tuning.py): the rate chosen on
the validation loss at L, never on the evaluated lengths, and the order of the families at the
tuned rates beside the order at the shared rate."""
import json
import math

from posbench.reports.report import write_report
from posbench.reports.tuning import family_of


def write_run(root, encoding, lr, seed, ppl_at_l, ppl_far, val_loss):
    run = root / f"{encoding}_lr{lr}_seed{seed}"
    run.mkdir(parents=True)
    curve = [{"length": n, "loss": math.log(p), "ppl": p}
             for n, p in ((32, ppl_at_l), (128, ppl_far))]
    record = {"encoding": encoding, "seed": seed, "status": "ok", "train": {"seq_len": 32},
              "eval": {"protocol": "nonoverlapping", "curve": curve},
              "config": {"encoding": {"name": encoding}, "seed": seed,
                         "train": {"seq_len": 32, "lr": lr}}}
    (run / "results.json").write_text(json.dumps(record))
    (run / "metrics.csv").write_text("step,loss,lr,tokens_per_second,val_loss\n"
                                     f"50,2.0,{lr},1000,\n100,1.9,{lr},1000,{val_loss + 0.5}\n"
                                     f"200,1.8,{lr},1000,{val_loss}\n")


def test_a_label_without_its_rate_names_the_family():
    assert family_of("rope [lr=0.001]") == "rope"
    assert family_of("rope [seq_len=64, lr=0.001]") == "rope [seq_len=64]"
    assert family_of("rope [lr=0.001, seq_len=64]") == "rope [seq_len=64]"
    assert family_of("t5 [position_lr_mult=1]") == "t5 [position_lr_mult=1]"


def test_each_family_is_read_at_the_rate_its_validation_loss_chose(tmp_path):
    # rope: 0.004 has the lower validation loss though 0.002 has the lower ppl at L; alibi: 0.002
    for seed in (0, 1):
        write_run(tmp_path, "rope", 0.002, seed, 3.0, 12.0, val_loss=1.30)
        write_run(tmp_path, "rope", 0.004, seed, 3.1, 6.0, val_loss=1.20 + 0.01 * seed)
        write_run(tmp_path, "alibi", 0.002, seed, 3.2, 3.2, val_loss=1.25)
        write_run(tmp_path, "alibi", 0.004, seed, 3.3, 3.4, val_loss=1.28)
    write_report(tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert "beside the rate every family shares (0.002)" in text
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
            for line in text.splitlines() if line.startswith("| rope |") or
            line.startswith("| alibi |")}
    assert rows["rope"][1] == "0.002: 1.3000, 0.004: 1.2050" and rows["rope"][2] == "0.004"
    assert rows["alibi"][2] == "0.002"
    # headline of the chosen group: mean over the lengths past L of ln(ppl(n)/ppl(L))
    assert rows["rope"][4] == f"{math.log(6.0 / 3.1):+.3f}"
    assert rows["rope"][6].rstrip(" |") == f"{math.log(12.0 / 3.0):+.3f}"
    assert ("Ordered by log-ppl growth past L (least first): tuned alibi < rope; at 0.002 alibi "
            "< rope; the same order.") in text


def test_a_tuned_rate_can_change_the_order(tmp_path):
    write_run(tmp_path, "rope", 0.002, 0, 3.0, 12.0, val_loss=1.30)
    write_run(tmp_path, "rope", 0.004, 0, 3.1, 3.2, val_loss=1.20)
    write_run(tmp_path, "alibi", 0.002, 0, 3.2, 3.5, val_loss=1.25)
    write_run(tmp_path, "alibi", 0.004, 0, 3.3, 3.4, val_loss=1.28)
    write_report(tmp_path)
    assert ("tuned rope < alibi; at 0.002 alibi < rope; the order changes with tuning."
            in (tmp_path / "summary.md").read_text())


def test_no_section_without_a_swept_rate(tmp_path):
    write_run(tmp_path, "rope", 0.002, 0, 3.0, 12.0, val_loss=1.30)
    write_run(tmp_path, "alibi", 0.002, 0, 3.2, 3.5, val_loss=1.25)
    write_report(tmp_path)
    assert "Learning rate tuned" not in (tmp_path / "summary.md").read_text()


def test_without_the_default_rate_the_shared_rate_is_the_best_common_one(tmp_path):
    for encoding, losses in (("rope", (1.30, 1.20)), ("alibi", (1.25, 1.28))):
        for lr, val in zip((0.001, 0.004), losses):
            write_run(tmp_path, encoding, lr, 0, 3.0, 4.0, val_loss=val)
    write_report(tmp_path)
    # mean validation loss over the families: 0.001 -> 1.275, 0.004 -> 1.24
    assert "beside the rate every family shares (0.004)" in (tmp_path / "summary.md").read_text()
