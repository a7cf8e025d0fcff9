"""Perplexity versus length: the same validation windows for every encoding, the same number of
scored tokens at every length."""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import List

import numpy as np
import torch
from tqdm import tqdm

from posbench.data.windows import eval_windows


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


@torch.no_grad()
def evaluate(model, data, eval_cfg, device: torch.device) -> List[dict]:
    """One curve point per length: mean next-token loss (nats) over the scored tokens, ppl = exp.
    Protocol `nonoverlapping`: each window of `length` tokens is scored in full. A length that runs
    out of memory is recorded as such and the others still run."""
    model.eval()
    model.encoding.set_eval_options(eval_cfg.get("rope_scaling", "none"),
                                    eval_cfg.get("logn_scaling", False))
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else nullcontext())
    curve = []
    lengths = list(eval_cfg.lengths)
    for length in tqdm(lengths, desc="eval", unit="length"):
        starts = eval_windows(data, length, eval_cfg.tokens)
        per_batch = max(1, eval_cfg.batch_tokens // length)
        total, count = 0.0, 0
        try:
            for i in range(0, len(starts), per_batch):
                rows = np.stack([data.tokens[s:s + length + 1] for s in starts[i:i + per_batch]])
                rows = torch.from_numpy(rows.astype(np.int64)).to(device)
                with autocast:
                    losses = model.token_losses(rows[:, :-1], rows[:, 1:])
                total += losses.double().sum().item()
                count += losses.numel()
        except Exception as err:  # noqa: BLE001 - only out-of-memory is recorded, not hidden
            if not _is_oom(err):
                raise
            if device.type == "cuda":
                torch.cuda.empty_cache()
            curve.append({"length": length, "status": "oom"})
            continue
        loss = total / count
        curve.append({"length": length, "loss": loss, "ppl": math.exp(loss), "tokens": count})
    return curve
