#!/usr/bin/env python3
"""Compares results files written by run.sh.

usage: compare.py [RESULTS_DIR]   (default target/braid-http-suite/results)

For each mode: the runs and their counts, the tests that failed in every
run, and the tests that failed in some runs only (flaky). Then the tests
that fail through braid-proxy but pass through nginx (and the reverse).
"""
import glob
import os
import sys

d = sys.argv[1] if len(sys.argv) > 1 else "target/braid-http-suite/results"


def read(path):
    info, failing, in_failing = {}, [], False
    for line in open(path, encoding="utf-8"):
        line = line.rstrip("\n")
        if line == "failing tests:":
            in_failing = True
            continue
        if in_failing:
            if line.startswith("  "):
                failing.append(line[2:])
                continue
            in_failing = False
        if ":" in line and not line.startswith(" "):
            k, v = line.split(":", 1)
            info[k.strip()] = v.strip()
    return info, failing


runs = {}
for path in sorted(glob.glob(os.path.join(d, "*.txt"))):
    info, failing = read(path)
    if "mode" not in info or not info.get("complete", "").startswith("yes"):
        continue
    if info.get("skipped", "0") != "0":  # a --filter run
        continue
    # one group per mode and proxy configuration (flags + binary hash)
    group = info["mode"]
    if info["mode"] != "direct":
        group += " [" + " ".join((info.get("proxy", "") + " " + info.get("proxy build", "")).split()) + "]"
    runs.setdefault(group, []).append((os.path.basename(path), info, set(failing)))

always, sometimes = {}, {}
for mode, rs in runs.items():
    print(f"== {mode}")
    for name, info, failing in rs:
        par = info["suite"].split("--in-parallel=")[1].split()[0]
        print(f"  {name}: {info['passed']} passed, {info['failed']} failed (in-parallel {par}; {info.get('proxy', '')})")
    sets = [f for _, _, f in rs]
    always[mode] = set.intersection(*sets)
    sometimes[mode] = set.union(*sets) - always[mode]
    print(f"  failed in every run ({len(always[mode])}):")
    for t in sorted(always[mode]):
        print(f"    {t}")
    print(f"  failed in some runs only ({len(sometimes[mode])}):")
    for t in sorted(sometimes[mode]):
        print(f"    {t}")
    print()

nginx_groups = [g for g in runs if g.startswith("nginx")]
if nginx_groups:
    ng = nginx_groups[0]
    ever_nginx = always[ng] | sometimes[ng]
    for bp in (g for g in runs if g.startswith("braid-proxy")):
        print(f"######## {bp}  vs  {ng}")
        bp_only = always[bp] - ever_nginx
        print(f"== failing in every braid-proxy run, passing in every nginx run ({len(bp_only)}):")
        for t in sorted(bp_only):
            print(f"    {t}")
        flaky = sometimes[bp] - ever_nginx
        print(f"== failing in some braid-proxy runs, passing in every nginx run ({len(flaky)}):")
        for t in sorted(flaky):
            print(f"    {t}")
        both = always[bp] & sometimes[ng]
        print(f"== failing in every braid-proxy run, in some nginx runs ({len(both)}):")
        for t in sorted(both):
            print(f"    {t}")
        ever_bp = always[bp] | sometimes[bp]
        ng_only = always[ng] - ever_bp
        print(f"== failing in every nginx run, passing in every braid-proxy run ({len(ng_only)}):")
        for t in sorted(ng_only):
            print(f"    {t}")
        print()
