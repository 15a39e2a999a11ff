"""Device-run helper (this session's ring probe): if bench_gluon's deeper packed ring beats the shipped nvfp4 seesaw
form at 320 rows by >= 3% at the same accuracy, rewrite nvfp4_seesaw_params in this (device) copy to it."""
import json
import re
import sys
from pathlib import Path

res = json.loads(Path(sys.argv[1]).read_text())["results"]
base = res["seesaw-nvfp4-tail"]
best, best_us = None, base["times"]["320"]["us"] * 0.97
for name, (ks, rs) in (("seesaw-nvfp4-rs3-ks2-tail", (2, 3)), ("seesaw-nvfp4-rs4-ks2-tail", (2, 4))):
    r = res.get(name, {})
    us = r.get("times", {}).get("320", {}).get("us")
    acc_ok = all(r.get(f"acc_splits{s}", {}).get("ok") and r[f"acc_splits{s}"]["rel_l2"]
                 <= 1.05 * base[f"acc_splits{s}"]["rel_l2"] for s in (1, 3))
    print(name, us, "acc ok" if acc_ok else "acc BAD")
    if us is not None and acc_ok and us < best_us:
        best, best_us = (ks, rs), us
if best:
    p = Path("vllm_kimi_dsa/kernels/gluon_seesaw.py")
    s, n = re.subn(r"SeesawParams\(k_stages=3, nvfp4=True, r_stages=2", f"SeesawParams(k_stages={best[0]}, nvfp4=True, "
                   f"r_stages={best[1]}", p.read_text())
    p.write_text(s)
    print(f"PICKED k_stages={best[0]} r_stages={best[1]} ({best_us:.1f} us; {n} rewritten)")
else:
    print("KEPT the shipped rings")
