"""Triton kernels for packed PACE recurrent states (issue 5): quantise/pack (quant_pack), the fused
buffered decode step and the per-token baseline (decode_step), segmented prefill (prefill), device
dispatch to the kernels or the pace_core reference (dispatch), the GPU test runner (gpu_check) and
the benchmark (bench). Measurements and analysis: kernels/NOTES.md, results in data/bench/."""
