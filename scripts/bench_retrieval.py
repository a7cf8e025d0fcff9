"""Cost of passkey retrieval (eval.retrieval) per length beside perplexity at the same length:
seconds and peak memory of one grid column (every depth x trials sequences of n tokens) and of one
perplexity point (eval.tokens tokens in windows of n), each in a fresh process so that the peak
is that length's own. The model is untrained (seeded): the cost does not depend on the weights.

    python scripts/bench_retrieval.py --encodings rope,alibi --lengths 128,256,512,1024,2048
"""
import argparse
import json
import os
import subprocess
import sys
import time


def peak_mib() -> float:
    """The process's peak RSS, VmHWM (ru_maxrss carries over from the parent through fork)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def case(encoding: str, length: int, what: str, overrides: list) -> dict:
    import torch

    import posbench
    from posbench import evaluations
    from posbench.data import prepare

    cfg = posbench.compose([f"encoding={encoding}", "device=cpu", f"eval.lengths=[{length}]",
                            "eval.retrieval.enabled=true", f"eval.retrieval.lengths=[{length}]",
                            *overrides])
    data = prepare(cfg.dataset)
    torch.manual_seed(0)
    model = posbench.build_model(cfg, data.vocab_size).eval()
    # both planned (windows, passkey sequences) before either is timed
    planned = {e.key: e for e in evaluations.plan(cfg, data)}
    start, began = peak_mib(), time.perf_counter()
    planned["retrieval" if what == "retrieval" else "curve"].run(model, torch.device("cpu"))
    return {"encoding": encoding, "length": length, "what": what,
            "seconds": time.perf_counter() - began, "peak_mib": peak_mib(), "start_mib": start,
            "threads": torch.get_num_threads(), "load_1min": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encodings", default="rope,alibi")
    parser.add_argument("--lengths", default="128,256,512,1024,2048")
    parser.add_argument("--overrides", default="", help="comma-separated config overrides")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # encoding:length:what, in a subprocess
    args = parser.parse_args()
    overrides = [o for o in args.overrides.split(",") if o]
    if args.case:
        encoding, length, what = args.case.split(":")
        print(json.dumps(case(encoding, int(length), what, overrides)))
        return
    rows = []
    for encoding in args.encodings.split(","):
        for length in map(int, args.lengths.split(",")):
            for what in ("retrieval", "perplexity"):
                out = subprocess.run([sys.executable, __file__, "--case",
                                      f"{encoding}:{length}:{what}", "--overrides",
                                      args.overrides], capture_output=True, text=True, check=True)
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), flush=True)
    print("\n| encoding | length | retrieval: s, peak MiB | perplexity: s, peak MiB |")
    print("|---|---:|---:|---:|")
    for encoding in args.encodings.split(","):
        for length in map(int, args.lengths.split(",")):
            cells = [next(r for r in rows if (r["encoding"], r["length"], r["what"])
                          == (encoding, length, what)) for what in ("retrieval", "perplexity")]
            print(f"| {encoding} | {length} | "
                  + " | ".join(f"{c['seconds']:.2f} s, {c['peak_mib']:.0f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
