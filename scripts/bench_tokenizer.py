"""Tokens per second of `dataset.tokenizer=gpt2` on real text, through the same
`Tokenizer.encode_all` that dataset preparation runs.

    python scripts/bench_tokenizer.py --tokenizer-path DIR --dataset pystdlib --megabytes 10

The text is a local corpus, pystdlib (the running interpreter's standard library: code) or pydocs
(the Python manuals: English prose, scripts/install_prose_corpus.sh), one document per file in the
corpus's order, up to the first document that brings it past --megabytes. DIR holds
GPT-2's vocab.json and merges.txt; without it the Hugging Face and tiktoken caches are looked in,
as for `dataset.tokenizer=gpt2`. Nothing is downloaded. Each run is timed from the first document
in to the last ids out; the fastest of --repeat runs is reported (on a shared machine, the one
least slowed by other work), in wall-clock and in CPU seconds of this process and its children.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import time

import posbench
from posbench.data import build_dataset
from posbench.data.tokenize import Tokenizer


def cpu_time() -> float:
    """CPU seconds of this process's threads and of its finished child processes: on a shared
    machine, what the work cost rather than how long it waited for a core."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--dataset", choices=["pystdlib", "pydocs"], default="pystdlib")
    p.add_argument("--megabytes", type=float, default=10.0)
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args(argv)
    overrides = [f"dataset={args.dataset}", "dataset.tokenizer=gpt2"]
    if args.tokenizer_path:
        overrides.append(f"dataset.tokenizer_path={args.tokenizer_path}")
    cfg = posbench.compose(overrides).dataset
    docs, size = [], 0
    for _, _, doc in build_dataset(cfg).documents().read():
        if size >= args.megabytes * 1e6:
            break
        docs.append(doc)
        size += len(doc)
    tokenizer = Tokenizer(cfg)
    seconds, cpu_seconds, tokens = [], [], 0
    for _ in range(args.repeat):
        start, cpu = time.perf_counter(), cpu_time()
        tokens = sum(len(ids) for ids in tokenizer.encode_all(iter(docs), "tokenize"))
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(cpu_time() - cpu)
    best = min(seconds)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{cpu_name()} ({platform.machine()}), {os.cpu_count()} cores",
              "python": platform.python_version(), "dataset": args.dataset,
              "tokenizer": tokenizer.identity,
              "documents": len(docs), "bytes": size, "tokens": tokens,
              "seconds": [round(s, 3) for s in seconds],
              "tokens_per_s": round(tokens / best), "mb_per_s": round(size / best / 1e6, 3),
              "tokens_per_cpu_s": round(tokens / min(cpu_seconds))}
    print(json.dumps(result))
    return result  # for tests/test_datasets.py


if __name__ == "__main__":
    main()
