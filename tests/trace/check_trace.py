#!/usr/bin/python3
"""check_trace.py - runs a 3-worker parameter-server job with TD_TRACE, merges the workers'
traces with tdist-trace and checks the merged timeline:
  - it is valid JSON in the Chrome trace event format (every event has ph, pid, tid, ts; spans
    have a non-negative dur; async begin/end and flow start/end come in pairs);
  - there is one process track per worker, named;
  - it holds what a parameter-server step does: the trainers' calls to the server and the
    server's handlers, distributed backward passes and optimizer steps;
  - causality survives the merge: every handler starts after its caller's send, in merged time
    (within the clock alignment's residual), although rank 1 pretends its clock runs 5 s ahead
    (TD_TRACE_TEST_SKEW_NS): the offsets estimated at rendezvous must undo it;
  - `tdist-trace html` renders it as one self-contained page with every worker and event.

    check_trace.py TDISTRUN PARAM_SERVER TDIST_TRACE
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

tdistrun, ps, merge = sys.argv[1:4]
work = tempfile.mkdtemp(prefix="td_trace_")
fails = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        fails.append(what)


try:
    env = dict(os.environ, TD_TRACE=os.path.join(work, "trace"), OPENBLAS_NUM_THREADS="1")
    # rank 1's clock pretends to run 5 s ahead: a shell wrapper sets the skew for that rank only
    wrapper = os.path.join(work, "skewed.sh")
    with open(wrapper, "w") as f:
        f.write('#!/bin/sh\n[ "$RANK" = 1 ] && export TD_TRACE_TEST_SKEW_NS=5000000000\n'
                f'exec "{ps}" "$@"\n')
    os.chmod(wrapper, 0o755)
    run = subprocess.run([tdistrun, "--standalone", "--nproc-per-node", "3", wrapper, "--epochs",
                          "1", "--max-batches", "5"], env=env, capture_output=True, text=True,
                         timeout=300)
    check(run.returncode == 0, f"param_server under tdistrun with TD_TRACE (exit {run.returncode})")
    if run.returncode != 0:
        print(run.stdout[-2000:], run.stderr[-4000:])
        sys.exit(1)
    out = os.path.join(work, "run.json")
    m = subprocess.run([merge, "merge", os.path.join(work, "trace"), "-o", out],
                       capture_output=True, text=True, timeout=60)
    check(m.returncode == 0, f"tdist-trace merge ({m.stderr.strip()})")
    doc = json.load(open(out))
    ev = doc["traceEvents"]
    check(len(ev) > 100, f"{len(ev)} events")
    bad = [e for e in ev if not all(k in e for k in ("ph", "pid", "tid", "ts"))]
    check(not bad, f"every event has ph, pid, tid, ts ({len(bad)} without)")
    spans = [e for e in ev if e["ph"] == "X"]
    check(all(e.get("dur", -1) >= 0 and "name" in e for e in spans), "spans have a name and dur >= 0")
    names = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    check(sorted(names) == [0, 1, 2], f"one named track per worker: {names}")
    for ph_open, ph_close, what in (("b", "e", "async call begin/end"), ("s", "f", "flow start/end")):
        opened = {e["id"] for e in ev if e["ph"] == ph_open}
        closed = {e["id"] for e in ev if e["ph"] == ph_close}
        check(opened == closed and opened, f"{what} pair up ({len(opened)} / {len(closed)})")
    handlers0 = [e for e in spans if e["pid"] == 0 and e["cat"] == "handler"]
    sends12 = [e for e in spans if e["pid"] in (1, 2) and e["cat"] == "rpc"]
    check(len(handlers0) > 5 and len(sends12) > 5,
          f"trainers call the server ({len(sends12)} sends, {len(handlers0)} server handlers)")
    check(any(e["cat"] == "autograd" and e["pid"] in (1, 2) for e in spans),
          "trainers run distributed backward passes")
    check(any(e["cat"] == "optim" and e["pid"] in (1, 2) for e in spans),
          "trainers step the distributed optimizer")
    workers = {w["rank"]: w for w in doc["otherData"]["tdist_workers"]}
    off1 = workers[1]["clock_offset_ns"] * 1e-9
    check(abs(off1 + 5.0) < 0.01, f"rank 1's 5 s skew estimated at rendezvous (offset {off1:.6f} s)")
    residual = max(w["clock_residual_ns"] for w in workers.values()) * 1e-3
    starts = {e["id"]: e["ts"] for e in ev if e["ph"] == "s"}
    late = [(e["id"], starts[e["id"]] - e["ts"]) for e in ev
            if e["ph"] == "f" and e["id"] in starts and e["ts"] + residual + 1.0 < starts[e["id"]]]
    check(not late, f"every handler starts after its caller's send in merged time "
          f"({len(starts)} calls; {len(late)} out of order beyond {residual:.1f} us)")
    # the offline page of the same run: every worker's track and the kinds of events above
    page = os.path.join(work, "run.html")
    h = subprocess.run([merge, "html", out, "-o", page], capture_output=True, text=True, timeout=60)
    check(h.returncode == 0, f"tdist-trace html ({h.stderr.strip()})")
    text = open(page).read() if h.returncode == 0 else ""
    check(all(f"{names[p]}: thread" in text for p in names), "the page has every worker's track")
    check(text.count('<g class="ev"') >= len([e for e in ev if e["ph"] in ("X", "b", "i")]),
          "the page draws every span, call and instant")
    check("[handler]" in text and "[autograd]" in text and "[optim]" in text,
          "the page holds handlers, backward passes and optimizer steps")
    check("http:" not in text and "https:" not in text and "src=" not in text,
          "the page is self-contained")
finally:
    shutil.rmtree(work, ignore_errors=True)
if fails:
    print(f"{len(fails)} checks failed")
    sys.exit(1)
print("PASS")
