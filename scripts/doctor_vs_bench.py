#!/usr/bin/env python3
"""Checks `sluice doctor`'s decode forecast against `sluice bench` on `sluice synth` models, on this machine.

For each case: write the model (random weights, a real model's shapes), run `sluice doctor --json` on its
config with the case's flags, then `sluice bench --json` with the same flags, and print one Markdown row:
forecast vs measured decode tok/s (steady state: bench's warm run, after a warm-up run of as many tokens, so
that the caches hold what they will hold), and the ratio. Doctor only sees the
config, the index and its own probes; nothing here feeds bench's numbers back into it.

"Streamed" cases make the experts bigger than their memory with flags rather than with a 30 GB file: a slot
cache of a quarter of the experts and --direct-io (no page cache), so every miss is a disk read, exactly as
when the model is bigger than RAM.

Usage: python3 scripts/doctor_vs_bench.py [--sluice target/release/sluice] [--dir /var/tmp/sluice-doctor]
Run it on a quiet machine (nothing else using the cores or the disk).
"""

import argparse
import json
import subprocess
from pathlib import Path

CASES = [
    # (name, synth args, flags for both tools, top-k values)
    ("qwen3-30b-a3b shape, 2 GB, in RAM", ["--shape", "qwen3-30b-a3b", "--size", "2G"], [], [2, 8]),
    ("qwen3.5-122b-a10b shape, 2 GB, in RAM", ["--shape", "qwen3.5-122b-a10b", "--size", "2G"], [], [8]),
    (
        "qwen3-30b-a3b shape, 2 GB, streamed: cache 1/4 of experts, direct I/O",
        ["--shape", "qwen3-30b-a3b", "--size", "2G"],
        ["--experts", "stream", "--expert-cache", "QUARTER", "--direct-io"],
        [2, 8],
    ),
    (
        "qwen3.5-122b-a10b shape, 2 GB, streamed: cache 1/4 of experts, direct I/O",
        ["--shape", "qwen3.5-122b-a10b", "--size", "2G"],
        ["--experts", "stream", "--expert-cache", "QUARTER", "--direct-io"],
        [8],
    ),
]


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sluice", default="target/release/sluice")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/sluice-doctor"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="doctor/bench pairs per row, alternated")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    print("| case | k | doctor tok/s (mean) | bench tok/s (warm, mean) | doctor ÷ bench | doctor: hit rate, limited by | bench: hit rate |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for name, synth, flags, ks in CASES:
        model = a.dir / synth[1]
        if not (model / "config.json").exists():
            run([a.sluice, "synth", *synth, "--out", str(model)])
        for k in ks:
            f = list(flags)
            if "QUARTER" in f:
                d = json.loads(run([a.sluice, "doctor", "--config", str(model), "--disk", str(a.dir), "--json",
                                    "--probe-seconds", "0.5", "--top-k", str(k)]))
                f[f.index("QUARTER")] = str(d["size"]["expert_bytes"] // 4)
            # The machine drifts between minutes: alternate doctor and bench, and compare the means.
            docs, benches = [], []
            for _ in range(a.repeats):
                docs.append(json.loads(run([a.sluice, "doctor", "--config", str(model), "--disk", str(a.dir),
                                            "--json", "--probe-seconds", "6", "--top-k", str(k), *f])))
                bench = json.loads(run([a.sluice, "bench", "-m", str(model), "--json", "--runs", "warm",
                                        "-n", str(a.tokens), "-p", "16", "--top-k", str(k), "--probe-seconds", "0",
                                        *f]))
                benches.append(next(r for r in bench["runs"] if r["run"] == "warm"))
            doc_tok_s = sum(d["warm"][0]["tok_s"] for d in docs) / len(docs)
            bench_tok_s = sum(b["decode_tok_s"] for b in benches) / len(benches)
            w = docs[-1]["warm"][0]
            print(f"| {name} | {k} | {doc_tok_s:.2f} | {bench_tok_s:.2f} | {doc_tok_s / bench_tok_s:.2f} | "
                  f"{w['hit_rate']:.0%}, {w['limited_by']} | {benches[-1]['hit_rate']:.0%} |", flush=True)
            for d, b in zip(docs, benches):
                p = d["probes"]
                disk = "/".join(f"{g:.2f}" for _, g in p["disk_gbps_by_depth"])
                print(f"<!-- doctor {d['warm'][0]['tok_s']:.2f}, bench {b['decode_tok_s']:.2f}; probes: disk {disk} "
                      f"GB/s at depth 1/2/4/8, DRAM {p['dram_gbps']:.1f} GB/s, matvec {p['matvec_gbps']:.1f} GB/s, "
                      f"{p['call_seconds'] * 1e6:.1f} us/call -->")

if __name__ == "__main__":
    main()
