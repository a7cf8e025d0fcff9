"""Cost of an evaluation section (passkey retrieval, RULER, LongPPL) per length beside perplexity
at the same length: seconds and peak memory of the section at one length (retrieval and RULER:
every depth x trials sequences of n tokens, each task; LongPPL: its short-context passes over the
perplexity windows) and of one perplexity point (eval.tokens tokens in windows of n), each in a
fresh process so that the peak is that length's own; the table gives the process's CPU seconds
(its threads' time, which other work on a shared machine does not inflate as it does the wall
time; both are in --json). The model is untrained (seeded): the cost does not depend on the
weights.

    python scripts/bench_evaluations.py --evaluation retrieval --encodings rope,alibi
    python scripts/bench_evaluations.py --evaluation ruler --encodings rope --lengths 128,2048
"""
import argparse
import json
import os
import subprocess
import sys
import time

# the sections whose cost this measures, and the overrides that run one at the length n alone
SECTIONS = {
    "retrieval": lambda n: ["eval.retrieval.enabled=true", f"eval.retrieval.lengths=[{n}]"],
    "ruler": lambda n: ["eval.ruler.enabled=true", f"eval.ruler.lengths=[{n}]"],
    # LongPPL scores the perplexity windows of every eval length; its evaluator: the run itself
    "longppl": lambda n: ["eval.longppl.enabled=true"],
}


def peak_mib() -> float:
    """The process's peak RSS, VmHWM (ru_maxrss carries over from the parent through fork)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def case(evaluation: str, encoding: str, length: int, what: str, overrides: list) -> dict:
    """One measurement in this process: `what` is the section or "perplexity"."""
    import torch

    import posbench
    from posbench import evaluations
    from posbench.data import prepare

    cfg = posbench.compose([f"encoding={encoding}", "device=cpu", f"eval.lengths=[{length}]",
                            *SECTIONS[evaluation](length), *overrides])
    data = prepare(cfg.dataset)
    torch.manual_seed(0)
    model = posbench.build_model(cfg, data.vocab_size).eval()
    # both planned (windows, task sequences) before either is timed
    planned = {e.key: e for e in evaluations.plan(cfg, data)}
    start, began, cpu = peak_mib(), time.perf_counter(), time.process_time()
    planned["curve" if what == "perplexity" else what].run(model, torch.device("cpu"))
    return {"evaluation": what, "encoding": encoding, "length": length,
            "seconds": time.perf_counter() - began, "cpu_seconds": time.process_time() - cpu,
            "peak_mib": peak_mib(), "start_mib": start,
            "threads": torch.get_num_threads(), "load_1min": os.getloadavg()[0]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluation", default="retrieval", choices=sorted(SECTIONS))
    parser.add_argument("--encodings", default="rope,alibi")
    parser.add_argument("--lengths", default="128,256,512,1024,2048")
    parser.add_argument("--overrides", default="", help="comma-separated config overrides")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # encoding:length:what, in a subprocess
    args = parser.parse_args(argv)
    overrides = [o for o in args.overrides.split(",") if o]
    if args.case:
        encoding, length, what = args.case.split(":")
        print(json.dumps(case(args.evaluation, encoding, int(length), what, overrides)))
        return
    rows, whats = [], (args.evaluation, "perplexity")
    for encoding in args.encodings.split(","):
        for length in map(int, args.lengths.split(",")):
            for what in whats:
                out = subprocess.run([sys.executable, __file__, "--evaluation", args.evaluation,
                                      "--case", f"{encoding}:{length}:{what}", "--overrides",
                                      args.overrides], capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"{encoding} at {length}, {what}: {out.stderr.strip()[-2000:]}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n| encoding | length | {args.evaluation}: CPU s, peak MiB | perplexity: CPU s, peak "
          "MiB |")
    print("|---|---:|---:|---:|")
    for encoding in args.encodings.split(","):
        for length in map(int, args.lengths.split(",")):
            cells = [next(r for r in rows if (r["encoding"], r["length"], r["evaluation"])
                          == (encoding, length, what)) for what in whats]
            print(f"| {encoding} | {length} | "
                  + " | ".join(f"{c['cpu_seconds']:.2f} s, {c['peak_mib']:.0f}" for c in cells)
                  + " |")


if __name__ == "__main__":
    main()
