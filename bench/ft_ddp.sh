#!/usr/bin/env bash
# ft_ddp.sh BUILD_DIR [RUNS] [NPROC] [DP] - what fault-tolerant data parallelism (td_ft_ddp, or
# td_ft_zero with DP zero1 / zero2 / zero3; gpt --ft) costs and how fast it recovers, with the GPT
# example (examples/gpt, its default model: 4 layers, width 128, context 64, batch 12 per
# replica) at NPROC (default 4) processes, float32, RUNS (default 3) interleaved repetitions of:
#   - gpt --nproc N --dp DP         (td_ddp, reduction overlapped with backward; or td_zero)
#   - gpt --nproc N --dp DP --ft    (td_ft_ddp or td_ft_zero, no failure)
#   - the PyTorch peer, bench/peers/torch/gpt.py --nproc N --dp ddp (DistributedDataParallel over
#     gloo), when python3 has torch and DP is ddp;
#   - gpt --dp DP --ft under tdistrun --tolerate-failures 1 with rank 2 SIGKILLed from outside
#     after 2 s of training: the time from the kill to the first step committed after it (the
#     survivors' wall clock, ft_first_commit_after_failure_unix_ms, against the time of the kill).
# Prints {"bench": "ft_ddp", "config": {... "dp"}, "results": {"step_s_plain" (td_ddp or td_zero;
# also "step_s_ddp" for ddp), "step_s_ft",
# "ft_overhead_vs_plain" (step_s_ft / step_s_plain - 1; "ft_overhead_vs_ddp" for ddp),
# "ft_machinery_share_of_step" (the time the fault tolerance itself spends per step, rank 0's,
# over its step time: what the step-time ratio measures through this host's noise; td_ft_zero's
# includes the optimizer steps of the blocks it backs and the commit vote), "step_s_torch_ddp",
# "ft_vs_torch_step_ratio",
# "kill_to_commit_s" (median), "kill_to_commit_runs_s", "recovery_in_library_s" (median: from the
# failure seen to the commit), "step_s_ft_after_failure" ...}} with medians over the runs (step
# times: train_s / steps). Steps: 30. Also a run with one spare (tdistrun with NPROC
# + 1 workers, gpt --spares 1, rank 2 killed the same way): "spare_kill_to_commit_s" (the kill
# to the first step committed with the spare healed in), "spare_heal_bytes", "spare_heal_GBps"
# (what the spare took over the time it took), "broadcast_GBps_same_bytes" (bench/collectives,
# a broadcast of that many bytes in a group of NPROC) and "spare_heal_vs_broadcast" (ddp: the
# heal's broadcasts; zero1/2/3: the spare's whole join, from entering the recovery to healed).
set -euo pipefail
build="${1:?usage: ft_ddp.sh BUILD_DIR [RUNS] [NPROC] [DP]}"
runs="${2:-3}"
nproc="${3:-4}"
dp="${4:-ddp}"
gpt="$build/examples/gpt"
tdistrun="$build/tools/tdistrun"
for f in "$gpt" "$tdistrun"; do
  [[ -x "$f" ]] || { echo "ft_ddp.sh: $f not found (build first)" >&2; exit 1; }
done
here="$(cd "$(dirname "$0")" && pwd)"
export OPENBLAS_NUM_THREADS=1
python3 - "$gpt" "$tdistrun" "$here/peers/torch/gpt.py" "$runs" "$nproc" "$dp" \
  "$build/bench/collectives" <<'PY'
import json, os, re, signal, statistics, subprocess, sys, time

gpt, tdistrun, peer, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
collectives = sys.argv[7]
nproc = sys.argv[5]
dp = sys.argv[6]
common = ["--steps", "30", "--eval-interval", "1000", "--eval-iters", "1"]

def last_json(text):
    for line in reversed(text.splitlines()):
        i = line.find("{\"bench\"")
        if i >= 0:
            return json.loads(line[i:])
    raise SystemExit("ft_ddp.sh: no JSON line in:\n" + text[-2000:])

def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"ft_ddp.sh: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}")
    return last_json(p.stdout)

def have_torch():
    try:
        return subprocess.run(["/usr/bin/python3", "-c", "import torch"],
                              capture_output=True).returncode == 0
    except OSError:
        return False

def rank_pid(root, rank):
    """The pid of the worker of tdistrun `root` whose environment says RANK=rank."""
    try:
        kids = open("/proc/%d/task/%d/children" % (root, root)).read().split()
    except OSError:
        return None
    for name in kids:
        try:
            env = open("/proc/%s/environ" % name, "rb").read().split(b"\0")
        except OSError:
            continue
        if b"RANK=%d" % rank in env:
            return int(name)
    return None

def killed_run(spares=0):
    steps = 30
    cmd = [tdistrun, "--standalone", "--nproc-per-node", str(int(nproc) + spares),
           "--tolerate-failures", "1", gpt, "--dp", dp, "--ft", "--steps", str(steps),
           "--eval-interval", "1000", "--eval-iters", "1", "--spares", str(spares)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, victim, t_kill = [], None, None
    fd = p.stdout.fileno()
    os.set_blocking(fd, False)
    started = None
    def drain():
        while True:
            try:
                b = os.read(fd, 65536)
            except BlockingIOError:
                return
            if not b:
                return
            out.append(b.decode(errors="replace"))
    while p.poll() is None:
        n = len(out)
        drain()
        if started is None and any("loss" in c for c in out[n:]):
            started = time.time()
        if victim is None:
            victim = rank_pid(p.pid, 2)
        if started and victim and t_kill is None and time.time() - started > 2.0:
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)  # a worker this script's tdistrun started, by pid
        time.sleep(0.01)
    drain()
    text = "".join(out)
    if p.returncode != 0 or t_kill is None:
        raise SystemExit(f"ft_ddp.sh: the killed run failed ({p.returncode}):\n{text[-3000:]}")
    r = last_json(text)["results"]
    line = [l for l in text.splitlines() if "gpt: step" in l]
    out = {"kill_to_commit_s": r["ft_first_commit_after_failure_unix_ms"] / 1000.0 - t_kill,
           "recovery_in_library_s": r["ft_recovery_max_s"],
           "step_s": r["train_s"] / steps, "line": line[0] if line else ""}
    if spares:  # "took X MiB of parameters and optimizer state in Y s (Z GB/s)"
        m = re.search(r"joined generation \d+ as a spare before step \d+: took ([0-9.]+) MiB .* "
                      r"in ([0-9.]+) s", text)
        if not m or r.get("ft_members_at_end") != int(nproc):
            raise SystemExit("ft_ddp.sh: no spare joined in:\n" + text[-3000:])
        out.update(heal_bytes=float(m.group(1)) * 1048576.0, heal_s=float(m.group(2)))
    return out

def bcast_gbps(nbytes):
    """The group's broadcast bandwidth (bench/collectives, algbw) for a message of nbytes."""
    size = str(int(nbytes) // 4 * 4)
    r = run([collectives, "--nprocs", nproc, "--ops", "broadcast", "--sizes", size])
    return r["results"]["runs"][0]["algbw_GBps"]

torch = dp == "ddp" and have_torch()
print(f"ft_ddp.sh: {runs} runs, PyTorch peer: {'yes' if torch else 'no'}", file=sys.stderr)
ddp, ft, tp, kills, share, mach, joins = [], [], [], [], [], [], []
for _ in range(runs):
    ddp.append(run([gpt, "--nproc", nproc, "--dp", dp] + common)["results"]["train_s"] / 30)
    r = run([gpt, "--nproc", nproc, "--dp", dp, "--ft"] + common)["results"]
    ft.append(r["train_s"] / 30)
    share.append(r["ft_machinery_share"])
    mach.append(r["ft_machinery_s_per_step"])
    if torch:
        r = run(["/usr/bin/python3", peer, "--nproc", nproc, "--dp", "ddp"] + common)["results"]
        tp.append(r["train_s"] / 30)
    kills.append(killed_run())
    joins.append(killed_run(spares=1))
med = statistics.median
res = {"step_s_plain": med(ddp), "step_s_ft": med(ft),
       "ft_overhead_vs_plain": med(ft) / med(ddp) - 1,
       "step_s_plain_runs": ddp, "step_s_ft_runs": ft,
       "kill_to_commit_s": med([k["kill_to_commit_s"] for k in kills]),
       "kill_to_commit_runs_s": [k["kill_to_commit_s"] for k in kills],
       "recovery_in_library_s": med([k["recovery_in_library_s"] for k in kills]),
       "step_s_ft_with_failure": med([k["step_s"] for k in kills]),
       "failure_line": kills[-1]["line"]}
# the time the fault tolerance itself spends per step (td_ft_step_info.machinery_s)
res.update(ft_machinery_s_per_step=med(mach), ft_machinery_share_of_step=med(share))
if dp == "ddp":
    res.update(step_s_ddp=med(ddp), ft_overhead_vs_ddp=med(ft) / med(ddp) - 1)
if joins:  # a spare healed in place of the killed worker
    hb = med([j["heal_bytes"] for j in joins])
    heal = med([j["heal_bytes"] / j["heal_s"] for j in joins if j["heal_s"] > 0]) * 1e-9
    bw = bcast_gbps(hb)
    res.update(spare_kill_to_commit_s=med([j["kill_to_commit_s"] for j in joins]),
               spare_kill_to_commit_runs_s=[j["kill_to_commit_s"] for j in joins],
               spare_recovery_in_library_s=med([j["recovery_in_library_s"] for j in joins]),
               spare_heal_bytes=hb, spare_heal_GBps=heal, broadcast_GBps_same_bytes=bw,
               spare_heal_vs_broadcast=heal / bw if bw > 0 else None,
               spare_failure_line=joins[-1]["line"])
if tp:
    res.update(step_s_torch_ddp=med(tp), ft_vs_torch_step_ratio=med(ft) / med(tp),
               step_s_torch_ddp_runs=tp)
cfg = {"nproc": int(nproc), "dp": dp, "load_avg_1_5_15m": list(os.getloadavg()), "model": "gpt defaults (4 layers, n_embd 128, block 64, batch 12/replica)",
       "dtype": "f32", "steps": 30, "steps_killed_run": 30, "runs": runs,
       "openblas_num_threads": 1, "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count()}
print(json.dumps({"bench": "ft_ddp", "config": cfg, "results": res}), flush=True)
PY
