import math

import numpy as np
import torch
from omegaconf import OmegaConf

import posbench
from posbench.data.windows import eval_windows
from posbench.evaluate import evaluate


def test_nonoverlapping_scores_the_same_windows_and_token_count(stdlib_data):
    cfg = posbench.compose(["encoding=alibi", "model.n_layer=1", "model.d_model=32",
                            "model.n_head=2"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg)
    eval_cfg = OmegaConf.create({"lengths": [64, 256], "tokens": 1024, "batch_tokens": 512,
                                 "protocol": "nonoverlapping"})
    curve = evaluate(model, stdlib_data, eval_cfg, torch.device("cpu"))
    assert [p["tokens"] for p in curve] == [1024, 1024]
    # recompute the 256 point by hand from the same windows
    starts = eval_windows(stdlib_data, 256, 1024)
    rows = torch.from_numpy(np.stack([stdlib_data.tokens[s:s + 257] for s in starts]).astype(np.int64))
    with torch.no_grad():
        logits = model(rows[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert math.isclose(curve[1]["loss"], loss, rel_tol=1e-5)
    assert math.isclose(curve[1]["ppl"], math.exp(curve[1]["loss"]), rel_tol=1e-12)
    # batching must not change the numbers
    other = evaluate(model, stdlib_data, OmegaConf.merge(eval_cfg, {"batch_tokens": 64}),
                     torch.device("cpu"))
    for a, b in zip(curve, other):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6)
