#!/usr/bin/env bash
# planned in session 21 for the next device session (NOT run yet). Attention's K/V reads moved onto the qkv GEMV:
# `benchmarks/h200_session21/next_early_trigger.patch` (`git apply` on main after session 21). Before the call:
#   git checkout -b wip/early-trigger && git apply benchmarks/h200_session21/next_early_trigger.patch && git commit -qam \
#     "the attention prologue triggers its dependents before its wait; partial's K/V L2 prefetch (session 21's patch)"
# What it changes (both off by default, so a run without the flags is main's engine):
# - `--prologue-early-trigger`: the attention prologue lets paged attention be scheduled before it waits for the qkv
#   GEMV (`pdl.trigger_dependents`), so three kernels are in flight: qkv running, the prologue waiting, attention
#   doing what it does before its own wait. Offline sm_90 build: PREEXIT before ACQBULK.
# - `--attention-prefetch-tiles N`: session 14's bulk L2 prefetch of each split's first N tiles of K and V before
#   the partial kernel's wait (the newest token left out). It lost then (-1.5-2.3 %) because it had only the prologue
#   (~1 us) to overlap; with the early trigger it has the qkv GEMV (~7 us, at 0.6 of HBM: ~12 MB of spare HBM
#   capacity against the 8.4 MB of K/V). Offline sm_90: 84 registers (96 without), 39 KB shared, as before.
# Resident profile (session 21, call 3): `_partial` adds 343 us a step (7.1 a layer) for 8.4 MB of K/V a layer.
# Predicted: early trigger alone +0-0.5 % (the block table and the context length overlap qkv instead of the
# prologue); early + 2 tiles (the whole split at 4K) +3-5 % resident (partial ~4 us a layer: q, table and K/V from
# L2), offloaded +0.5-1 %; prefetch alone: session 14's loss again (the control).
# 0. GPU tests the change touches (`test_early_trigger_and_kv_prefetch_change_nothing`: qkv GEMV -> prologue ->
#    attention replayed from graphs, bitwise across the 8 variants, against the reference); stops on failure.
# 1. Resident A/B, alternating twice. 2. The profile of early + 2 tiles. 3. Offloaded with it.
# If it wins: keep the winning settings as the engine's (no switch), drop the others, and run all of tests/gpu.
# Run as: LIMIT=480 bash benchmarks/h200_session21/planned_next.sh
CALL=next LIMIT=${LIMIT:-480}
. "$(dirname "$0")/../h200_session19/common.sh"
gpu_tests 200 tests/gpu/test_paged_attention_gpu.py tests/gpu/test_norm_rope_gpu.py tests/gpu/test_pdl_gpu.py
for i in 1 2; do
  run res_main_$i 25 "$RES"
  run res_early_$i 25 "$RES" --prologue-early-trigger
  run res_early_pf1_$i 25 "$RES" --prologue-early-trigger --attention-prefetch-tiles 1
  run res_early_pf2_$i 25 "$RES" --prologue-early-trigger --attention-prefetch-tiles 2
  run res_pf2_$i 25 "$RES" --attention-prefetch-tiles 2
done
run res_prof_early_pf2 50 "$RES --profile 4" --prologue-early-trigger --attention-prefetch-tiles 2
run off_early_pf2 75 "$OFF" --prologue-early-trigger --attention-prefetch-tiles 2
