#!/usr/bin/env bash
# sluice beside llama.cpp on the same weights, in one run, with this machine's limits probed in the same run.
# The project's copy of ../shared/peers/compare.sh (same models, same flags, same measurements) with additions:
# `large` also measures warm decode (llama.cpp: a second run right after the cold one, its page cache holding
# what fits; sluice: bench's warm run after its cold one), and prints sluice's bounds (bench's optimal-cache
# bound and in-RAM compute of the same shape), and runs sluice a second time on the same weights converted to a
# packed store (`STORE=0` skips it; `STORE_LAYOUT=mlx|tiled` picks its `--layout`, default `auto`); `medium` runs
# both engines ROUNDS times (default 3) in alternating order and gives medians and each round's ratio, and prints
# the weight bytes each decode streams per second for both, against the DRAM probe (bench's
# `weight_bytes_per_token`, the same for both: identical weights).
#   compare.sh medium   : 7.7 B Qwen3-MoE (H2048, 24 layers, 64 experts top-8), 4.35 GB: fits in RAM
#   compare.sh large    : 51.7 B (48 layers, 224 experts top-8), 29 GB: bigger than a 24 GB machine's RAM
# Needs a release build of sluice (SLUICE=path, default target/release/sluice), root (drops the page cache) and
# the peers kit (PEERS=dir with setup.sh and make_medium_model.py, default ../shared/peers beside the repo).
# LLAMA_BIN=dir runs llama.cpp from another build of the same source. On a CPU with AMX the kit's native build
# segfaults in ggml's AMX matmul (llama.cpp issue 20824; seen on every Sapphire Rapids VM here), so there, unless
# LLAMA_BIN is given, the same source is built once more with AMX off, into $PEERS_DIR/llama-noamx, and used
# (`docs/performance-log.md`: llama.cpp then decodes at a third of its AMD speed, so those ratios flatter sluice).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PEERS=${PEERS:-$HERE/../../shared/peers}
OWN_LLAMA_BIN=${LLAMA_BIN:-}
source "$PEERS/setup.sh"
if [ -z "$OWN_LLAMA_BIN" ] && grep -qw amx_tile /proc/cpuinfo; then
  NOAMX="$PEERS_DIR/llama-noamx"
  if [ ! -x "$NOAMX/bin/llama-bench" ]; then
    echo "note: this CPU has AMX; building llama.cpp without it into $NOAMX" >&2
    flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S "$SRC" -B "$NOAMX" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
      -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" > "$PEERS_DIR/cmake-config-noamx.log" 2>&1
    cmake --build "$NOAMX" -j"$(nproc)" --target llama-bench llama-completion > "$PEERS_DIR/llama-build-noamx.log" 2>&1
  fi
  OWN_LLAMA_BIN="$NOAMX/bin"
fi
LLAMA_BIN=${OWN_LLAMA_BIN:-$LLAMA_BIN}
[ -x "$LLAMA_BIN/llama-bench" ] || { echo "no llama-bench in LLAMA_BIN=$LLAMA_BIN"; exit 1; }
PRESET=${1:?usage: compare.sh medium|large}
SLUICE=${SLUICE:-target/release/sluice}
[ -x "$SLUICE" ] || { echo "no sluice binary at $SLUICE (cargo build --release, or set SLUICE)"; exit 1; }
M="$PEERS_DIR/models"; R="$PEERS_DIR/results"; mkdir -p "$M" "$R"
case $PRESET in
  medium) GEN=(--preset medium); NAME=medium ;;
  large) GEN=(--preset large --exp w=12); NAME=large-w12 ;;
  *) echo "unknown preset $PRESET"; exit 1 ;;
esac
MLX="$M/$NAME-mlx"; GGUF="$M/$NAME-q4_0.gguf"; STORE_DIR="$M/$NAME-store"
rm -rf "$STORE_DIR"   # a packed store is converted afresh from this run's weights (large, below)
gen() { "$PY" "$PEERS/make_medium_model.py" "${GEN[@]}" --mlx-out "$MLX" --gguf-out "$GGUF" "$@"; }
# Both formats of `large` take 58 GB. Where the disk has less room than both plus a margin, each format is
# written just before its runs and the other deleted first: the generator is seeded, so the weights are the
# same as when both are written at once.
ONE_AT_A_TIME=0
if ! { [ -f "$MLX/config.json" ] && [ -f "$GGUF" ]; }; then
  need=$([ "$PRESET" = large ] && echo 64 || echo 12)
  free=$(df --output=avail -BG "$M" | tail -1 | tr -dc 0-9)
  if [ "$free" -ge "$need" ]; then gen; else ONE_AT_A_TIME=1; echo "note: ${free} GB free, under ${need}: one format at a time" >&2; fi
fi
want_gguf() { [ "$ONE_AT_A_TIME" = 1 ] && [ ! -f "$GGUF" ] && { rm -rf "$MLX"; gen --no-mlx; }; return 0; }
want_mlx() { [ "$ONE_AT_A_TIME" = 1 ] && [ ! -f "$MLX/config.json" ] && { rm -f "$GGUF"; gen --no-gguf; }; return 0; }
OUT="$R/$NAME-$(date +%Y%m%dT%H%M)"; mkdir -p "$OUT"
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
quiet() { local a b; for _ in $(seq 60); do a=($(head -1 /proc/stat)); sleep 2; b=($(head -1 /proc/stat))
  local t=0 i; for i in 1 2 3 4 5 6 7 8; do t=$((t + b[i] - a[i])); done
  [ $(( (b[4] - a[4]) * 100 / t )) -ge 90 ] && return; done; echo "warning: machine not idle" >&2; }
want_gguf
if [ "$PRESET" = medium ]; then
  # ROUNDS rounds (default 3), each one llama.cpp run and one sluice run of both workloads, in alternating
  # order (llama.cpp first in odd rounds): this host switches between a fast and a slow state every few tens
  # of seconds, which moved the ratio of back-to-back runs by up to 40%. The table gives each engine's median
  # and the median of the rounds' ratios. With one format at a time on disk, all llama.cpp rounds run first.
  ROUNDS=${ROUNDS:-3}
  llama_round() { quiet; "$LLAMA_BIN/llama-bench" -m "$GGUF" -t "$(nproc)" -p 512 -n 64 -r 1 -o json > "$OUT/llama-r$1.json"
    quiet; "$LLAMA_BIN/llama-bench" -m "$GGUF" -t "$(nproc)" -p 0 -n 32 -d 512 -r 1 -o json > "$OUT/llama-d512-r$1.json"; }
  sluice_round() { quiet; "$SLUICE" bench -m "$MLX" -p 16 -n 64 --runs warm --json ${SLUICE_FLAGS:-} > "$OUT/sluice-r$1.json"
    quiet; "$SLUICE" bench -m "$MLX" -p 512 -n 32 --runs warm --json ${SLUICE_FLAGS:-} > "$OUT/sluice-d512-r$1.json"; }
  if [ "$ONE_AT_A_TIME" = 1 ]; then
    for r in $(seq "$ROUNDS"); do llama_round "$r"; done
    want_mlx
    for r in $(seq "$ROUNDS"); do sluice_round "$r"; done
  else
    for r in $(seq "$ROUNDS"); do
      if [ $((r % 2)) = 1 ]; then llama_round "$r"; sluice_round "$r"; else sluice_round "$r"; llama_round "$r"; fi
    done
  fi
else
  # llama.cpp cannot repack (copy) 29 GB into 24 GB of RAM: weights stay in the mmap. Its timed decode follows
  # an untimed 16-token context (-d 16), as sluice's follows its 16-token prompt: both start decoding with the
  # experts those tokens used already read (about 44% of each layer's here).
  # llama-bench draws its tokens from an unseeded std::rand(), so its warm run feeds the cold run's tokens again
  # and finds exactly their experts in the page cache; sluice's warm run feeds new ones. The warm ratio leans
  # toward llama.cpp by that much.
  quiet; drop; "$LLAMA_BIN/llama-bench" -m "$GGUF" -t "$(nproc)" -p 0 -n 32 -d 16 -r 1 --repack 0 -o json > "$OUT/llama.json"
  "$LLAMA_BIN/llama-bench" -m "$GGUF" -t "$(nproc)" -p 0 -n 32 -d 16 -r 1 --repack 0 -o json > "$OUT/llama-warm.json"
  want_mlx
  quiet; drop; "$SLUICE" bench -m "$MLX" -p 16 -n 32 --runs both --json ${SLUICE_FLAGS:-} > "$OUT/sluice.json"
  # The same weights as a packed store (`sluice convert`: one read per record instead of one per tensor),
  # converted afresh from this run's MLX directory and deleted after its run (it takes as much disk as the
  # model). STORE=0 skips it.
  free=$(df --output=avail -BG "$M" | tail -1 | tr -dc 0-9)
  if [ "${STORE:-1}" = 1 ] && [ "$free" -ge 30 ]; then
    "$SLUICE" convert --model "$MLX" --out "$STORE_DIR" --layout "${STORE_LAYOUT:-auto}" > "$OUT/convert.log" 2>&1
    quiet; drop; "$SLUICE" bench -m "$STORE_DIR" -p 16 -n 32 --runs both --json ${SLUICE_FLAGS:-} > "$OUT/sluice-store.json"
    rm -rf "$STORE_DIR"
  elif [ "${STORE:-1}" = 1 ]; then
    echo "note: ${free} GB free, under 30: no packed-store run" >&2
  fi
fi
"$PY" - "$OUT" "$PRESET" <<'PY'
import json, sys, os, re
out, preset = sys.argv[1], sys.argv[2]
import statistics
# Each row's (llama.cpp, sluice) figures, one pair per round (medium) or a single pair (large).
per_round = {}
if preset == "medium":
    rounds = sorted(int(m.group(1)) for f in os.listdir(out) if (m := re.fullmatch(r"sluice-r(\d+)\.json", f)))
    sluice_runs = [json.load(open(f"{out}/sluice-{k}r{r}.json")) for r in rounds for k in ("", "d512-")]
    sl = sluice_runs[0]
    for i, r in enumerate(rounds):
        ll = json.load(open(f"{out}/llama-r{r}.json"))
        short, deep = sluice_runs[2 * i]["runs"][-1], sluice_runs[2 * i + 1]["runs"][-1]
        for name, a, b in [
            ("decode tok/s (short prompt)", max(x["avg_ts"] for x in ll if x["n_gen"] > 0), short["decode_tok_s"]),
            ("decode tok/s, 512 tokens deep", json.load(open(f"{out}/llama-d512-r{r}.json"))[0]["avg_ts"],
             deep["decode_tok_s"]),
            ("prefill tok/s, 512-token prompt", max(x["avg_ts"] for x in ll if x["n_prompt"] > 0),
             deep["prefill_tok_s"]),
        ]:
            per_round.setdefault(name, []).append((a, b))
else:
    sl = json.load(open(f"{out}/sluice.json"))
    runs = {r["run"]: r for r in sl["runs"]}
    ll = json.load(open(f"{out}/llama.json"))
    tg = max(r["avg_ts"] for r in ll if r["n_gen"] > 0)
    warm = json.load(open(f"{out}/llama-warm.json"))[0]["avg_ts"]
    per_round["decode tok/s, cold"] = [(tg, runs["cold"]["decode_tok_s"])]
    per_round["decode tok/s, warm"] = [(warm, runs["warm"]["decode_tok_s"])]
    if os.path.exists(f"{out}/sluice-store.json"):
        st = json.load(open(f"{out}/sluice-store.json"))
        st_runs = {r["run"]: r for r in st["runs"]}
        per_round["decode tok/s, cold, packed store"] = [(tg, st_runs["cold"]["decode_tok_s"])]
        per_round["decode tok/s, warm, packed store"] = [(warm, st_runs["warm"]["decode_tok_s"])]
# Per row: each engine's median and the median of the rounds' ratios (with one pair: the pair and its ratio).
rows = [(n, statistics.median(a for a, _ in p), statistics.median(b for _, b in p), statistics.median(b / a for a, b in p))
        for n, p in per_round.items()]
lines = [f"# {preset}: sluice beside llama.cpp ({os.path.basename(out)})", ""]
if preset == "medium":
    lines += [f"{len(rounds)} rounds, each engine once per round in alternating order: medians, and the median of the "
              "rounds' ratios", "", "| | llama.cpp | sluice | sluice ÷ llama.cpp | per round |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {a:.2f} | {b:.2f} | {q:.2f} | "
              + ", ".join(f"{y:.2f} vs {x:.2f}: {y / x:.2f}" for x, y in per_round[n]) + " |" for n, a, b, q in rows]
else:
    lines += ["| | llama.cpp | sluice | sluice ÷ llama.cpp |", "|---|---|---|---|"]
    lines += [f"| {n} | {a:.2f} | {b:.2f} | {q:.2f} |" for n, a, b, q in rows]
lines += ["", f"sluice mode {sl['mode']}, disk probe {sl.get('disk_probe_gb_s') or 0:.2f} GB/s "
          f"(best at depth {sl.get('disk_probe_depth')} in {sl.get('disk_probe_pieces')} piece(s), its short window "
          f"{sl.get('disk_probe_window_gb_s') or 0:.2f}, re-read {sl.get('disk_reread_gb_s') or 0:.2f}), "
          f"DRAM probe {sl.get('dram_probe_gb_s') or 0:.1f} GB/s, fresh memory {sl.get('fresh_memory_gb_s') or 0:.2f} GB/s"]
w, dram = sl.get("weight_bytes_per_token"), sl.get("dram_probe_gb_s")
if w and dram and preset == "medium":
    lines.append(f"DRAM probe patterns: one stream per thread {sl.get('dram_one_stream_gb_s') or 0:.1f}, "
                 f"four in lockstep {sl.get('dram_four_streams_gb_s') or 0:.1f} GB/s (the probe is the faster)")
    probes = [run.get("dram_probe_gb_s") or 0 for run in sluice_runs]
    lines.append("DRAM probe of each sluice run in round order: " + ", ".join(f"{p:.1f}" for p in probes)
                 + f" GB/s; the weight rates below are the medians' against the first ({dram:.1f})")
    for n, a, b, _ in rows:
        if n.startswith("decode"):
            lines.append(f"{n}: weights streamed ({w / 1e6:.1f} MB/token) llama.cpp {a * w / 1e9:.1f} GB/s = "
                         f"{a * w / 1e9 / dram:.0%} of the DRAM probe, sluice {b * w / 1e9:.1f} GB/s = {b * w / 1e9 / dram:.0%}")
    # The host's memory speed can change between rounds (the probes above): each sluice run against the probe
    # it took itself, seconds after its runs (`bench` probes DRAM once they are done).
    # sluice_runs holds each round's short-prompt run, then its 512-deep run.
    for n, first in [("decode tok/s (short prompt)", 0), ("decode tok/s, 512 tokens deep", 1)]:
        shares = [(b * w / 1e9, run.get("dram_probe_gb_s")) for (_, b), run in zip(per_round[n], sluice_runs[first::2])]
        lines.append(f"{n}: sluice's weight rate per round against its own run's probe: "
                     + ", ".join(f"{g:.1f} of {p:.1f} GB/s = {g / p:.0%}" if p else f"{g:.1f} GB/s (no probe)"
                                 for g, p in shares))
if sl.get("slots_backed_seconds") is not None:
    lines.append(f"sluice load {sl['load_seconds']:.1f} s, then {sl['slots_backed_seconds']:.1f} s until its expert slots were "
                 f"backed with memory (the runs start after both; llama.cpp's page cache is backed during its runs)"
                 + (f", {100 * sl['slots_on_huge_pages']:.0f}% of them on huge pages"
                    if sl.get("slots_on_huge_pages") is not None else ""))
ram = sl.get("in_ram")
if ram:
    lines.append(f"in-RAM compute of the same shape: prefill {ram['prefill_tok_s']:.2f}, decode {ram['decode_tok_s']:.2f} tok/s")
sources = [("", sl)]
if preset == "large" and os.path.exists(f"{out}/sluice-store.json"):
    sources.append((" (packed store)", st))
    log = open(f"{out}/convert.log").read() if os.path.exists(f"{out}/convert.log") else ""
    found = re.search(r"GB, (records [^)]*)\)", log)
    layout = found.group(1) if found else "layout not in convert.log"
    lines.append(f"packed store ({layout}): disk probe {st.get('disk_probe_gb_s') or 0:.2f} GB/s "
                 f"(best at depth {st.get('disk_probe_depth')} in {st.get('disk_probe_pieces')} piece(s), its short "
                 f"window {st.get('disk_probe_window_gb_s') or 0:.2f}, re-read {st.get('disk_reread_gb_s') or 0:.2f}), "
                 f"DRAM probe {st.get('dram_probe_gb_s') or 0:.1f} GB/s")
for label, run in [(label, r) for label, src in sources for r in src["runs"]]:
    name = run["run"] + label
    b = run.get("decode_bound")
    bound = (f", bound {b['tok_s']:.2f} tok/s ({b['limit']}), achieved {b['achieved']:.0%}; with an LRU cache "
             f"({b['lru_misses_per_token']:.1f} misses/token against the optimum's {b['optimal_misses_per_token']:.1f}) "
             f"{b['lru_tok_s']:.2f} tok/s, achieved {b['lru_achieved']:.0%}") if b else ""
    probes = run.get("disk_probes_gb_s")
    probed = f"disk probes {probes[0]:.2f} before and {probes[1]:.2f} after it (bounds at the faster); " if probes else ""
    lines.append(f"{name}: {probed}read {run['read_bytes_per_token'] / 1e6:.0f} MB/token at {run['read_gb_s']:.2f} GB/s, "
                 f"hit rate {run['hit_rate']:.2f}, I/O wait {run['io_wait_share']:.0%}{bound}")
lines += ["", "raw: llama*.json, sluice*.json beside this file"]
open(f"{out}/report.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "report: $OUT/report.md"
