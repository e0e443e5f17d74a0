#!/usr/bin/env bash
# pipeline_schedules.sh BUILD_DIR [ARGS...] - samples/s of the GPT (examples/gpt_3d) in 2 pipeline
# stages (2 processes, --dp 1 --tp 1) with each schedule, GPipe then 1F1B, on the fortunes corpus.
# ARGS (shared with the peer, bench/peers/torch/pipeline_schedules.py): --steps, --micro-batches,
# --batch-size, --block-size, --n-layer, --n-head, --n-embd, --seed, --corpus; the defaults are the
# peer's (20 steps, 4 micro-batches, batch 16, context 64, 4 layers, 4 heads, width 128).
# Prints {"bench": "pipeline_schedules", "config": {...}, "results": {"schedules": [{"schedule",
# "samples_per_s", "tokens_per_s", "wall_s", "final_loss", "peak_live_microbatches_per_stage"}]}};
# samples_per_s counts sequences over the steps after the first. Run by bench/compare.sh
# pipeline_schedules beside the peer.
set -euo pipefail
build="${1:?usage: pipeline_schedules.sh BUILD_DIR [ARGS...]}"
shift
gpt3d="$build/examples/gpt_3d"
[[ -x "$gpt3d" ]] || { echo "pipeline_schedules.sh: $gpt3d not found (build first)" >&2; exit 1; }
defaults=(--steps 20 --micro-batches 4 --batch-size 16 --block-size 64 --n-layer 4 --n-head 4
          --n-embd 128)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for s in gpipe 1f1b; do
  "$gpt3d" --dp 1 --pp 2 --tp 1 --schedule "$s" "${defaults[@]}" "$@" 2>"$tmp/$s.err" \
    >"$tmp/$s.out" || { cat "$tmp/$s.err" >&2; exit 1; }
done
python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
rows, cfg = [], None
for s in ("gpipe", "1f1b"):
    line = [l for l in open(f"{tmp}/{s}.out") if l.startswith("{")][-1]
    j = json.loads(line)
    cfg, r = j["config"], j["results"]
    sps = r["samples_per_s_after_first_step"]
    rows.append({"schedule": s, "samples_per_s": sps, "tokens_per_s": sps * cfg["block_size"],
                 "wall_s": r["wall_s"], "final_loss": r["final_loss"],
                 "peak_live_microbatches_per_stage": r["peak_live_microbatches_per_stage"]})
cfg = {k: cfg[k] for k in ("steps", "micro_batches", "batch_size", "block_size", "n_layer",
                           "n_head", "n_embd")}
cfg.update(stages=2, processes=2)
print(json.dumps({"bench": "pipeline_schedules", "config": cfg, "results": {"schedules": rows}}),
      flush=True)
PY
