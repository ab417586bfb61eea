"""Session 23, call 11: which Triton kernels miss the in-memory JIT cache during eager decode, and why. Call 10's
profile of an eager run found the final norm's `rms_norm` compiling (a disk-cache load, ~37 ms) at every step.
Runs decode_variants.py's eager resident case in-process with a jit_cache_hook that prints each miss's kernel,
specialization and key. Run on a GPU as: PYTHONPATH=. python benchmarks/h200_session23/jit_misses.py -- RES_EAGER"""

import collections
import runpy
import sys

import triton

misses = collections.Counter()


def hook(**kw):  # triton's keywords: key, repr, fn, compile, is_manual_warmup, already_compiled
    name = getattr(kw.get("fn"), "name", "?")
    misses[name] += 1
    if misses[name] <= 3 or name == "_rms_norm":
        print(f"JIT miss {misses[name]} {str(kw.get('repr'))[:400]} key={str(kw.get('key'))[:300]}", flush=True)
    return False


triton.knobs.runtime.jit_cache_hook = hook
sys.argv = ["benchmarks/decode_variants.py", *sys.argv[1:]]
try:
    runpy.run_path("benchmarks/decode_variants.py", run_name="__main__")
finally:
    print("JIT misses by kernel:", dict(misses), flush=True)
