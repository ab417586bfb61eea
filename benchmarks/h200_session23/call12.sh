#!/usr/bin/env bash
# session 23, call 12: session 22's last engine commit (d0e079b: paged_decode_attention takes launch_args once) was
# never run on a GPU. Its GPU tests (attention, prologue, PDL), then the resident figure. Predicted: all pass,
# ~389 tok/s (session 22: 389.5).
# Run as: LIMIT=170 bash benchmarks/h200_session23/call12.sh
CALL=call12 LIMIT=${LIMIT:-170}
. "$(dirname "$0")/../h200_session19/common.sh"
gpu_tests 120 tests/gpu/test_paged_attention_gpu.py tests/gpu/test_norm_rope_gpu.py tests/gpu/test_pdl_gpu.py
run res 25 "$RES"
