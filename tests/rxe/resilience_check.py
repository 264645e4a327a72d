#!/usr/bin/env python3
"""The resilience suite's checker (tests/rxe/run_resilience.sh, tests/multihost/run.sh).

    resilience_check.py SCENARIO --dir SCRATCH --json OUT [--json OUT2] [times...]

Holds what the clients saw (SCRATCH/client*.json, SCRATCH/client*.outcomes:
"TAG SEQ STATUS" for each call not idempotent) against what the server did
(SCRATCH/executions.log: "TAG SEQ CLIENT_INCARNATION CALL_ID SERVER_INCARNATION"
for each run of a call not idempotent, across restarts), prints the figures,
writes them as one JSON object to each OUT, and exits 1 on a fault:
  - a call run twice: a (TAG, SEQ) or a (client incarnation, call id) with
    more than one line in the log;
  - a call lost: ended ok but never ran, or ran but never ended;
  - an outcome other than ok (and unknown_outcome, for a call not idempotent
    across a server restart, where the scenario allows it), a wrong reply.
client_kills checks the server's samples (fds, VmRSS) for an upward slope.
"""
import argparse
import glob
import json
import os
import sys

OK, UNKNOWN_OUTCOME = 0, 6


def executions(scratch):
    by_id, by_call = {}, {}
    path = os.path.join(scratch, "executions.log")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) != 5:
                    continue  # a line cut short cannot be: one write(2) each
                tag, seq, cinc, cid, _sinc = parts
                by_id[(int(tag), int(seq))] = by_id.get((int(tag), int(seq)), 0) + 1
                by_call[(cinc, cid)] = by_call.get((cinc, cid), 0) + 1
    return by_id, by_call


def outcomes(scratch):
    out = {}
    for path in sorted(glob.glob(os.path.join(scratch, "client*.outcomes"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                tag, seq, status = (int(x) for x in line.split())
                out[(tag, seq)] = status
    return out


def clients(scratch):
    found = []
    for path in sorted(glob.glob(os.path.join(scratch, "client*.json"))):
        with open(path, encoding="utf-8") as f:
            found.append(json.load(f))
    return found


def slope(ys):
    """Least-squares slope of ys against 0, 1, 2..."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx = (n - 1) / 2
    my = sum(ys) / n
    num = sum((i - mx) * (y - my) for i, y in enumerate(ys))
    den = sum((i - mx) ** 2 for i in range(n))
    return num / den


def exactly_once(scratch, allow_unknown, faults):
    """The calls not idempotent: none twice, none lost; their figures."""
    by_id, by_call = executions(scratch)
    seen = outcomes(scratch)
    twice = sum(1 for n in by_id.values() if n > 1) + sum(1 for n in by_call.values() if n > 1)
    lost = sum(1 for k, st in seen.items() if st == OK and by_id.get(k, 0) != 1)
    unended = sum(1 for k in by_id if k not in seen) if seen else 0
    unknown = [k for k, st in seen.items() if st == UNKNOWN_OUTCOME]
    unknown_ran = sum(1 for k in unknown if by_id.get(k, 0) == 1)
    other = sum(1 for st in seen.values() if st not in (OK, UNKNOWN_OUTCOME))
    if twice:
        faults.append(f"{twice} call(s) not idempotent ran twice")
    if lost:
        faults.append(f"{lost} call(s) ended ok but the server's log has no single run of them")
    if unended:
        faults.append(f"{unended} call(s) ran but the client recorded no outcome")
    if unknown and not allow_unknown:
        faults.append(f"{len(unknown)} call(s) ended unknown_outcome where the server never restarted")
    if other:
        faults.append(f"{other} call(s) not idempotent ended neither ok nor unknown_outcome")
    return {
        "executions": sum(by_id.values()),
        "not_idempotent_calls": len(seen),
        "run_twice": twice,
        "lost": lost,
        "ran_without_outcome": unended,
        "unknown_outcome": len(unknown),
        "unknown_outcome_that_ran": unknown_ran,
    }


def load_figures(cs, faults, allow_unknown):
    total = {k: sum(c[k] for c in cs) for k in
             ("calls", "ok", "ok_idempotent", "ok_not_idempotent", "unknown_outcome",
              "peer_gone", "timed_out", "other", "bad_replies")}
    for c in cs:
        for k in ("peer_gone", "timed_out", "other", "bad_replies"):
            if c[k]:
                faults.append(f"client {c['tag']}: {c[k]} call(s) {k}")
        if c["refused_at_start"]:
            faults.append(f"client {c['tag']}: start() refused calls: {c['refused_at_start']}")
        if c["ok_idempotent"] == 0 or c["ok_not_idempotent"] == 0:
            faults.append(f"client {c['tag']}: no ok call of each kind")
    if not allow_unknown and total["unknown_outcome"]:
        faults.append(f"{total['unknown_outcome']} unknown_outcome where none may be")
    total["calls_per_s"] = round(sum(c["calls_per_s"] for c in cs), 1)
    total["p50_us_max"] = max((c["p50_us"] for c in cs), default=0)
    total["p99_us_max"] = max((c["p99_us"] for c in cs), default=0)
    total["counters"] = {k: sum(c["counters"][k] for c in cs) for k in cs[0]["counters"]} if cs else {}
    return total


def resume_after(c, t):
    """Seconds from t to the end of the client's first gap in ok results that spans t."""
    for g in c["gaps"]:
        if g["from"] <= t + 0.5 and g["to"] > t:
            return round(g["to"] - t, 3)
    return None


def resume_after_fault(c, t0, t1):
    """Seconds from t1 (the fault's end) to the end of the client's outage: its
    gap in ok results that overlaps [t0, t1] most (a short stall just before
    the fault is not it). 0 when the client resumed before t1 was taken (`ip
    link set up` returns after the port is already active); None: no such gap."""
    best, overlap = None, 0.0
    for g in c["gaps"]:
        o = min(g["to"], t1) - max(g["from"], t0)
        if o > overlap:
            best, overlap = g, o
    return None if best is None else round(max(best["to"] - t1, 0.0), 3)


def first_state_after(c, t, state):
    for s in c["states"]:
        if s["t"] >= t and s["state"] == state:
            return round(s["t"] - t, 3)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--json", action="append", default=[])
    ap.add_argument("--kernel", default="")
    ap.add_argument("--commit", default="")
    for t in ("t-kill", "t-restart", "t-serving", "t-stop", "t-cont", "t-last", "t-empty",
              "t-down", "t-up"):
        ap.add_argument("--" + t, type=float)
    for ms in ("keepalive-ms", "keepalive-timeout-ms", "linger-ms", "loss-percent"):
        ap.add_argument("--" + ms, type=float)
    a = ap.parse_args()
    faults = []
    fig = {"scenario": a.scenario, "kernel": a.kernel, "commit": a.commit}
    cs = clients(a.dir)
    if a.scenario == "server_kill":
        fig["load"] = load_figures(cs, faults, allow_unknown=True)
        fig["exactly_once"] = exactly_once(a.dir, True, faults)
        fig["resume_s_after_restart"] = [resume_after(c, a.t_restart) for c in cs]
        # The new server's start (device, listener) up to its "serving on" line;
        # the clients may resume before the driver has seen that line.
        fig["server_start_s"] = round(a.t_serving - a.t_restart, 3)
        fig["reconnecting_s_after_kill"] = [first_state_after(c, a.t_kill, "reconnecting") for c in cs]
        fig["downtime_s"] = round(a.t_serving - a.t_kill, 3)
        if any(r is None for r in fig["resume_s_after_restart"]):
            faults.append("a client shows no resumption after the restart")
    elif a.scenario in ("silent_peer", "link_down"):
        t0, t1 = (a.t_stop, a.t_cont) if a.scenario == "silent_peer" else (a.t_down, a.t_up)
        fig["load"] = load_figures(cs, faults, allow_unknown=False)
        fig["exactly_once"] = exactly_once(a.dir, False, faults)
        fig["keepalive_ms"], fig["keepalive_timeout_ms"] = a.keepalive_ms, a.keepalive_timeout_ms
        fig["detection_s"] = [first_state_after(c, t0, "reconnecting") for c in cs]
        fig["resume_s"] = [resume_after(c, t1) if a.scenario == "silent_peer"
                           else resume_after_fault(c, t0, t1) for c in cs]
        fig["fault_s"] = round(t1 - t0, 3)
        if any(d is None for d in fig["detection_s"]):
            faults.append("a client never went reconnecting")
        if any(r is None for r in fig["resume_s"]):
            faults.append("a client shows no resumption")
        if a.scenario == "link_down" and any(first_state_after(c, t0, "ready") is None for c in cs):
            faults.append("a client never connected again after the link came back")
        if fig["load"]["counters"].get("keepalive_timeouts", 0) == 0 and a.scenario == "silent_peer":
            faults.append("no client counted a keepalive timeout")
    elif a.scenario == "loss":
        fig["load"] = load_figures(cs, faults, allow_unknown=False)
        fig["exactly_once"] = exactly_once(a.dir, False, faults)
        # One client a loss rate, its tag 100 + the rate in percent.
        fig["phases"] = [{"loss_percent": c["tag"] - 100, "calls": c["calls"], "ok": c["ok"],
                          "calls_per_s": c["calls_per_s"], "p50_us": c["p50_us"],
                          "p99_us": c["p99_us"], "client_counters": c["counters"]}
                         for c in sorted(cs, key=lambda c: c["tag"])]
    elif a.scenario == "client_kills":
        rows = []
        with open(os.path.join(a.dir, "samples"), encoding="utf-8") as f:
            for line in f:
                i, fds, rss, cc, ccalls, tk, td = line.split()
                rows.append((int(i), int(fds), int(rss), int(cc), int(ccalls), float(tk), float(td)))
        # A row after each round of kills, its first field the kills so far:
        # the rows of the last 150 kills.
        total = rows[-1][0]
        last = [r for r in rows if r[0] > total - 150]
        fds = [r[1] for r in last]
        rss = [r[2] for r in last]
        drop = sorted(r[6] - r[5] for r in rows)
        fig["kills"] = total
        fig["samples"] = len(rows)
        fig["fds"] = {"first": rows[0][1], "last": rows[-1][1], "min_last150": min(fds),
                      "max_last150": max(fds),
                      "slope_per_kill": round(slope(fds) * len(last) / 150, 4)}
        fig["rss_kb"] = {"first": rows[0][2], "last": rows[-1][2], "min_last150": min(rss),
                         "max_last150": max(rss),
                         "slope_per_kill": round(slope(rss) * len(last) / 150, 3)}
        fig["cached_clients_max"] = max(r[3] for r in rows)
        fig["dropped_s"] = {"p50": round(drop[len(drop) // 2], 3), "max": round(drop[-1], 3)}
        fig["cache_empty_s_after_last_kill"] = round(a.t_empty - a.t_last, 3)
        fig["bound_s"] = (a.keepalive_timeout_ms + a.linger_ms) / 1000
        fig["exactly_once"] = exactly_once(a.dir, True, faults)
        # Flat: the fd count does not grow over the last 150 kills, and RSS
        # grows by less than 4 KiB a kill (600 KiB over them: the ring arena
        # takes and trims 2 MiB areas as connections come and go, which is
        # noise here; a connection's rings or registration left behind would
        # be hundreds of KiB a kill).
        if fig["fds"]["slope_per_kill"] > 0.01 or max(fds) > min(fds) + 2:
            faults.append(f"the server's fd count grows: {fig['fds']}")
        if fig["rss_kb"]["slope_per_kill"] > 4.0:
            faults.append(f"the server's RSS grows: {fig['rss_kb']}")
        # The bound is the library's (keepalive_timeout + linger), gated on the
        # fake link's virtual clock; here, under TCG, it gets 5 s of slack.
        if fig["cache_empty_s_after_last_kill"] > fig["bound_s"] + 5:
            faults.append("the reply cache kept a killed client past keepalive_timeout + linger + 5 s")
    else:
        print(f"resilience_check: unknown scenario {a.scenario}", file=sys.stderr)
        return 2
    fig["faults"] = faults
    fig["result"] = "FAIL" if faults else "OK"
    text = json.dumps(fig, indent=1)
    print(text)
    for out in a.json:
        try:
            with open(out, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:
            print(f"resilience_check: {out}: {e}", file=sys.stderr)
    for fault in faults:
        print(f"resilience_check: FAULT: {fault}", file=sys.stderr)
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
