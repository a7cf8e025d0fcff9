import math
import resource

import numpy as np
import torch
from omegaconf import OmegaConf

import posbench
from posbench.evaluations.perplexity import evaluate
from helpers import window_starts


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
    starts = window_starts(stdlib_data, 256, 1024)
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


def address_space_in_use() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024


def test_a_length_that_runs_out_of_memory_is_recorded_and_the_later_ones_still_run(stdlib_data):
    """A real allocation failure: the address space is capped 24 MiB above what the process
    maps, so 64-token windows fit but the 64 MiB score blocks of 4096 and 8192 tokens cannot be
    allocated (dense-score path: DA-Transformer)."""
    cfg = posbench.compose(["encoding=da_transformer", "model=tiny", "model.n_layer=1"])
    torch.manual_seed(0)
    model = posbench.build_model(cfg)
    eval_cfg = OmegaConf.create({"lengths": [64, 4096, 8192], "tokens": 8192, "batch_tokens": 64,
                                 "protocol": "nonoverlapping"})
    first = evaluate(model, stdlib_data, OmegaConf.merge(eval_cfg, {"lengths": [64]}),
                     torch.device("cpu"))  # warms up the allocator outside the cap
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (address_space_in_use() + 24 * 2**20, hard))
    try:
        curve = evaluate(model, stdlib_data, eval_cfg, torch.device("cpu"))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert curve[0] == first[0]
    assert curve[1:] == [{"length": 4096, "status": "oom"}, {"length": 8192, "status": "oom"}]
    # and with the memory back, the same lengths are scored
    assert all("loss" in p for p in evaluate(model, stdlib_data, eval_cfg, torch.device("cpu")))
