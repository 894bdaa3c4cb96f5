#!/usr/bin/env bash
# The GPU correctness call of issue 40 on one CUDA machine, from the repository root:
#   scripts/gpu_call.sh [checks | kernels analyses] [results] [timing] [study4b] [app4b]
# kernels: the kernels' tests compiled at full Qwen3.5 shapes (kernels/bench/gpu_check.py; about 6 minutes on an H100
#          with compilation: a call of its own), log in $OUT;
# analyses: GPU = CPU for every analysis and the decode graphs = the runs without them (tests/test_analysis_backends.py,
#          tests/test_graphs.py with PACE_KERNEL_TESTS=cuda; about 2 minutes), log in $OUT;
# checks:  kernels, then analyses;
# results: `python -m pace_core all --device cuda --ppl-tokens 0` (the embedded model's stored results on the whole
#          test split: calibration, export, structure, sweep, drift, perplexity, generations, compare, claims) into
#          $RESULTS (default /tmp/results), resuming from .gpu_results/results.tar.gz where an earlier call left one,
#          packed into $OUT/results.tar.gz at the end or when $BUDGET_S seconds (default 560) are spent;
# timing:  the same from scratch into a scratch folder, each result file's time listed (issue 43's figure: the whole
#          study of the embedded model in minutes);
# study4b: `all` on a random checkpoint of the Qwen3.5-4B shape with every named configuration, timed from scratch;
# app4b:   scripts/measure_app.py on that checkpoint (every view's first visit on this fresh host, and the median).
# The kernels' roofline is kernels/bench/roofline.py, the widths' kernels/bench/widths_gpu.py (their own calls).
# The corpus is read from ../shared/corpus, or from .corpus/ (a copy carried to a machine without ../shared).
# A copy of the tree whose .git is another's names its own commit in every result's provenance when the caller
# passes it: `env $(python -m pace_core.version --copied) scripts/gpu_call.sh` (run where the copy was made: the
# commit and its code tree, which pace_core.version.code_commit compares the copy's files with).
set -u
OUT=${OUT:-/tmp/out}
RESULTS=${RESULTS:-/tmp/results}
BUDGET_S=${BUDGET_S:-560}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$RESULTS"
if [ ! -f ../shared/corpus/wikitext2-test.txt ] && [ -d .corpus ]; then
  mkdir -p ../shared && ln -sfn "$PWD/.corpus" ../shared/corpus
fi
left() { echo $((BUDGET_S - SECONDS)); }
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
  "transformers", transformers.__version__, torch.cuda.get_device_name())' | tee "$OUT/versions.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/versions.txt"
stages=("$@"); [ $# -gt 0 ] || stages=(checks results)
expanded=()
for stage in "${stages[@]}"; do
  if [ "$stage" = checks ]; then expanded+=(kernels analyses); else expanded+=("$stage"); fi
done
for stage in "${expanded[@]}"; do
  case $stage in
    kernels)
      timeout "$(left)" python3 kernels/bench/gpu_check.py > "$OUT/gpu_check_log.txt" 2>&1
      echo "gpu_check exit $? after ${SECONDS}s"; tail -3 "$OUT/gpu_check_log.txt" ;;
    analyses)
      PACE_KERNEL_TESTS=cuda timeout "$(left)" python3 -m pytest -p no:cacheprovider -rfE -vv --durations=15 \
        tests/test_analysis_backends.py tests/test_graphs.py > "$OUT/analysis_backends_log.txt" 2>&1
      echo "analysis backends exit $? after ${SECONDS}s"; tail -3 "$OUT/analysis_backends_log.txt" ;;
    results)
      [ -f .gpu_results/results.tar.gz ] && tar -xzf .gpu_results/results.tar.gz -C "$RESULTS"
      timeout "$(left)" python3 -m pace_core all --device cuda --ppl-tokens 0 --quiet --out "$RESULTS" \
        > "$OUT/all_log.txt" 2>&1
      echo "all exit $? after ${SECONDS}s"; grep '^==' "$OUT/all_log.txt" | tail -3
      tar -czf "$OUT/results.tar.gz" -C "$RESULTS" . ;;
    timing)  # the whole split's study timed step by step (results kept out of $RESULTS: nothing resumed)
      rm -rf /tmp/timing && timeout "$(left)" python3 -m pace_core all --device cuda --ppl-tokens 0 --out /tmp/timing \
        > "$OUT/all_timing_log.txt" 2>&1
      echo "all (timed, from scratch) exit $? after ${SECONDS}s"
      ls -l --time-style=+%T /tmp/timing/*/ | awk '{print $6, $7}' | sort > "$OUT/all_timing_files.txt" ;;
    study4b)  # issue 43's second figure: `all` on the 4B shape with every named configuration, timed from scratch
      python3 scripts/random_checkpoint.py --shape qwen3.5-4b --out /tmp/q4b --device cuda > "$OUT/q4b_log.txt" 2>&1
      rm -rf /tmp/res4b && timeout "$(left)" python3 -m pace_core all --model /tmp/q4b --device cuda --out /tmp/res4b \
        --configs $(python3 -c 'from pace_core.config import NAMED_CONFIGS; print(*NAMED_CONFIGS)') \
        > "$OUT/all_4b_log.txt" 2>&1
      echo "all on the 4B shape exit $? after ${SECONDS}s"
      ls -l --time-style=+%T /tmp/res4b/*/ | awk '{print $6, $7}' | sort > "$OUT/all_4b_files.txt" ;;
    app4b)  # every view's first visit on a fresh host (the first run beside the median), 4B shape fp32
      if ! python3 -c 'import streamlit, plotly' 2>/dev/null; then  # the device image has neither (2026-12-06)
        echo "app4b: streamlit or plotly is missing here: carry their wheels and those of their needs (README of"
        echo "the device tools: pip download --no-deps for Python 3.12) and install them into PYTHONPATH first"
        continue
      fi
      [ -d /tmp/q4b ] || python3 scripts/random_checkpoint.py --shape qwen3.5-4b --out /tmp/q4b --device cuda \
        > "$OUT/q4b_log.txt" 2>&1
      timeout "$(left)" python3 scripts/measure_app.py --model /tmp/q4b --device cuda --repeats 2 --out "$OUT" \
        > "$OUT/app_4b_log.txt" 2>&1
      echo "measure_app on the 4B shape exit $? after ${SECONDS}s" ;;
    *) echo "unknown stage $stage (allowed: checks, kernels, analyses, results, timing, study4b, app4b)"; exit 2 ;;
  esac
done
