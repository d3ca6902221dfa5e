#!/usr/bin/env bash
# One H200 call of the device tool (see ../shared/gpuhost/stage-wheels): install the staged CuTe DSL
# wheels and this tree, then run the named steps, each writing a bundle with k3-verify itself (or a JSON
# report for the driver scripts), and pack them into $OUT:
#   smoke     k3-verify run --tier smoke          (kernel compile + numerics with counters + sanitizer + probes)
#   bench     k3-verify bench kernels             (kernels vs cuBLAS / fla / PyTorch, cold L2, % of HBM floor)
#   sweep     k3-verify run --tier scripts/gpu/gemm-sweep.yaml   (GEMM heuristic constants, one at a time)
#   numerics  k3-verify run --tier scripts/gpu/kernels-numerics.yaml (every kernel GPU test, counters)
#   kernels2  k3-verify run --tier scripts/gpu/kernels-ii.yaml   (all kernel GPU tests + router/MLA/experts bench)
#   gputests  pytest -v -m gpu on the kernel tests named in $K3_GPU_TESTS (default: every tests/test_*gpu*.py;
#             the log names every test passed, also when the step is cut short, with what each printed: -rP)
#   executor  python scripts/gpu/decode_executor_check.py        (decode executor vs reference, graphs)
#   decode    k3-verify run --tier scripts/gpu/decode-sweep-quick.yaml  (decode step sweep, fast vs standard;
#             TP2 points too when two GPUs are visible: the nvidia-h200-x2 kind)
#   decodes3  k3-verify run --tier scripts/gpu/decode-sweep-s3.yaml (batch 1/8/64 x 1K/32K/128K x TP1/TP2)
#   decodemini  the same on the smallest grid (scripts/gpu/decode-sweep-mini.yaml, ~5 min)
#   equiv     k3-verify run --tier scripts/gpu/equivalence-grid.yaml (batch 1/2/8/64 x short/32K/128K, 256 steps)
#   equiv32 / equiv128  the same at 32K / 128K only (scripts/gpu/equivalence-{32k,128k}.yaml), one call each
#   decodes4  k3-verify run --tier scripts/gpu/decode-sweep-s4.yaml (batch 1..64 x 1K/32K/128K x TP1/TP2,
#             fast vs standard at both TP sizes, per-layer-type times of both graph paths)
#   rankemu   k3-verify run --tier scripts/gpu/rank-emulation.yaml (k3-tp16-rank / k3-tp8-rank:experts=N points)
#   sanitizer k3-verify run --tier scripts/gpu/sanitizer.yaml (4 tools: kernels + an executor step's two streams)
#   tp2       python scripts/gpu/tp2_check.py                   (TP2 vs TP1, fused vs unfused all-reduce + norm)
#   audit:C1,C2  k3-verify bundle audit of the part bundle $K3_AUDIT_BUNDLE (default /tmp/bundles/h200-standard),
#             checks C1,C2 re-executed
#   auditplant:C1  scripts/gpu/plant_record.py forges a re-sealed copy of it (verify passes), then audits C1 of
#             the copy: the audit must exit 1 (the fabricated record found)
#   tier:NAME k3-verify run --tier scripts/gpu/NAME.yaml (any tier file there, e.g. tier:decode-sweep-s5,
#             tier:rank-emulation-s5, tier:equivalence-b64); K3_STEP_TIMEOUT applies as for the others
#   sentinel-train  python -m k3_fastpath.sentinel.train --out /tmp/sentinel, its schedule fitted to 60 s
#             under K3_STEP_TIMEOUT, K3_TRAIN_PROFILE=1 adds --profile, K3_TRAIN_ARGS more options (e.g.
#             "--batch 64"; training.json and the log come back; the checkpoint (195 MiB: more than a call
#             brings back) stays in /tmp for a later call on the same warm machine)
#   sentinel-probes  short trainings, one per ';'-separated option set in K3_PROBES (e.g. "--mix mrcr=1;--mix
#             mrcr=1 --mrcr-chars 600 --mrcr-needles 1,2"), each within K3_PROBE_S (default 150 s; the schedule
#             fitted to it): their training.json (per-task loss curve, held-out scores) as sentinel-probe-N.json
#   sentinel-repro  a 20-step sentinel training, then its rebuild with --expect-digest (the first's digest)
#   sentinel-evals  K3_SENTINEL_DIR=/tmp/sentinel k3-verify run --tier scripts/gpu/sentinel-evals.yaml, within
#             K3_EVAL_S (default 300 s); K3_EVAL_ONLY=evals.gsm8k,... runs only those checks (--only)
#   sentinel-standard  K3_SENTINEL_DIR=/tmp/sentinel k3-verify run --tier standard --only $K3_EVAL_ONLY (default
#             evals.gsm8k,evals.aime25,evals.mrcr,likelihood.gold_answers): the standard tier's own sentinel
#             evals and the gold answers' likelihood (its sizes), within
#             K3_EVAL_S (default 520 s)
#   sentinel-defects  one run per planted defect (verify/defects.py; K3_DEFECTS, default all) of the tier of the
#             clean run (the last sentinel-evals or sentinel-standard bundle on this machine: run one first),
#             with its checks and sizes (--only as it ran, or K3_DEFECT_ONLY: a subset of them), each run's torch
#             CPU threads the cores / runs at once, --engine builtin:fast+defect=NAME against
#             K3_DEFECT_BASELINE (default builtin:fast, the clean fast path; builtin:reference is ~27x slower),
#             each within K3_EVAL_S (default 560), then `python -m verify.defects table CLEAN DEFECTS...`
#             (sentinel-defects.md: which eval caught which defect); each run's budgets K3_DEFECT_BUDGETS
#             (default "evals.gsm8k=180 evals.aime25=120 evals.mrcr=90 likelihood.gold_answers=260": the fast path
#             on both sides, where the tiers' budgets are sized for the eager reference; on an H100 with six runs
#             at once, bundles/runs/2026-12-07-h100-session31: gsm8k 160 s, aime25 98 s, likelihood 246 s a run,
#             alone 7.4 s a side for gsm8k, bundles/runs/2026-12-07-h100-session30); K3_DEFECT_PARALLEL runs (default 1) at once
#             on the GPU (the sentinel's steps leave it mostly idle; the clean run has compiled every kernel),
#             each serving K3_DEFECT_MAX_LEN positions (--max-model-len; default 16,384), at most as many as the
#             free GPU memory holds (two fast engines a run, their slot pools sized by that length)
#   triton-cache  pack the Triton cache (/tmp/triton-cache: fla's compiled kernels and autotuning results,
#             TRITON_PRINT_AUTOTUNING=1 logs each autotuning) into $OUT/triton-cache.tar.gz.part-aa, -ab, ...
#             (15 MB each: a file over 16 MiB does not come back; after sentinel-train the cache was 32 MB); a later machine
#             starts from it when the call carries .gpucache/ (ignored by git) holding that file
#   part:TIER one part of a resumable run of TIER (smoke | standard | full | a .yaml path) into
#             /tmp/bundles/h200-TIER: `--time-limit` 30 s under K3_STEP_TIMEOUT, `--resume` when that bundle
#             exists (a later call on the same warm machine, or the bundle carried back in .gpubundles/)
# Usage on the GPU host, from the repo root:  bash scripts/gpu/h200_smoke_and_bench.sh STEP [STEP ...]
# ("all" = smoke bench). Staging with the device tool (a later call's carry drops the earlier carried
# folder, so park `a` in /tmp):
#   call 1: carry [".gpuwheels/a"], command: mkdir -p /tmp/gwa && cp .gpuwheels/a/* /tmp/gwa/
#   call 2: carry [".gpuwheels/b"], command: mkdir -p .gpuwheels/a && cp /tmp/gwa/* .gpuwheels/a/ &&
#           source .gpuwheels/b/env.sh && bash scripts/gpu/h200_smoke_and_bench.sh smoke
#   call 3 (same warm machine): as call 2 with the next steps.
# The copied tree has no .git: pass K3_SOURCE_COMMIT=<sha> in the command (the bundle also records
# source_tree_sha256, a hash of the package sources, either way).
# Keep K3_STEP_TIMEOUT (default 520 s per step) at least 30 s under the call's limit_s (which shrinks with
# the session's device time left): a call killed by the device tool returns nothing. On SIGTERM the bundles
# written so far are still packed into $OUT.
set -uo pipefail
[ $# -eq 0 ] && set -- all
: "${OUT:?OUT must point at the folder whose files come back}"
export PYTHONUNBUFFERED=1 K3_KERNEL_CACHE=/tmp/k3cache NCCL_NVLS_ENABLE=0 TRITON_CACHE_DIR=/tmp/triton-cache \
  TRITON_PRINT_AUTOTUNING=${TRITON_PRINT_AUTOTUNING:-1}
# the cache's parts: carried in .gpucache/, or parked in /tmp/gpucache by an earlier call on this machine (with
# .gpuwheels/b the parts exceed the 64 MiB a call carries: send .gpucache in a call of its own, copying it there)
tc=$(ls .gpucache/triton-cache.tar.gz* /tmp/gpucache/triton-cache.tar.gz* 2>/dev/null | sort)
if [ -n "$tc" ] && [ ! -d /tmp/triton-cache ]; then
  mkdir -p /tmp/triton-cache && cat $tc | tar -C /tmp/triton-cache -xz && echo "triton cache: restored ($(echo $tc | wc -w) parts)"
fi
source .gpuwheels/b/env.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/nvidia-smi.csv"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
# the GPU in the bundles' names (h200, h100, ...): the device tool may hand out either
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE 'H[0-9]+' | head -1 | tr 'H' 'h')
gpu=${gpu:-gpu}
mkdir -p /tmp/bundles
rc=0
T=${K3_STEP_TIMEOUT:-520}
pack() { tar -C /tmp/bundles -czf "$OUT/bundles-$stamp.tar.gz" . 2>/dev/null; }
trap 'echo "terminated: packing what was written"; pack; exit 143' TERM INT
for what in "$@"; do
  case "$what" in
    all) steps="smoke bench" ;;
    *) steps="$what" ;;
  esac
  for s in $steps; do
    echo "=== step $s ($(date -u +%T))"
    case "$s" in
      smoke) timeout -s TERM "$T" python3 -m verify.cli run --tier smoke --output "/tmp/bundles/$stamp-$gpu-smoke" 2>&1 | tee "$OUT/smoke.log" || rc=1 ;;
      bench) timeout -s TERM "$T" python3 -m verify.cli bench kernels --output "/tmp/bundles/$stamp-$gpu-bench-kernels" 2>&1 | tee "$OUT/bench.log" || rc=1 ;;
      kernels2) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/kernels-ii.yaml --output "/tmp/bundles/$stamp-$gpu-kernels-ii" 2>&1 | tee "$OUT/kernels2.log" || rc=1 ;;
      numerics) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/kernels-numerics.yaml --output "/tmp/bundles/$stamp-$gpu-kernels-numerics" 2>&1 | tee "$OUT/numerics.log" || rc=1 ;;
      sweep) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/gemm-sweep.yaml --output "/tmp/bundles/$stamp-$gpu-gemm-sweep" 2>&1 | tee "$OUT/sweep.log" || rc=1 ;;
      gputests) timeout -s TERM "$T" python3 -m pytest -v -rP --tb=short -m gpu -p no:cacheprovider ${K3_GPU_TESTS:-tests/} 2>&1 | tee "$OUT/gputests.log" | tail -60 || rc=1 ;;
      executor) timeout -s TERM "$T" python3 scripts/gpu/decode_executor_check.py 2>&1 | tail -80 | tee "$OUT/executor.log" || rc=1 ;;
      decode) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/decode-sweep-quick.yaml --output "/tmp/bundles/$stamp-$gpu-decode-sweep" 2>&1 | tee "$OUT/decode.log" || rc=1 ;;
      decodes3) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/decode-sweep-s3.yaml --output "/tmp/bundles/$stamp-$gpu-decode-sweep-s3" 2>&1 | tee "$OUT/decodes3.log" || rc=1 ;;
      decodemini) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/decode-sweep-mini.yaml --output "/tmp/bundles/$stamp-$gpu-decode-mini" 2>&1 | tee "$OUT/decodemini.log" || rc=1 ;;
      equiv) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/equivalence-grid.yaml --output "/tmp/bundles/$stamp-$gpu-equivalence-grid" 2>&1 | tee "$OUT/equiv.log" || rc=1 ;;
      equiv32) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/equivalence-32k.yaml --output "/tmp/bundles/$stamp-$gpu-equivalence-32k" 2>&1 | tee "$OUT/equiv32.log" || rc=1 ;;
      equiv128) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/equivalence-128k.yaml --output "/tmp/bundles/$stamp-$gpu-equivalence-128k" 2>&1 | tee "$OUT/equiv128.log" || rc=1 ;;
      decodes4) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/decode-sweep-s4.yaml --output "/tmp/bundles/$stamp-$gpu-decode-sweep-s4" 2>&1 | tee "$OUT/decodes4.log" || rc=1 ;;
      rankemu) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/rank-emulation.yaml --output "/tmp/bundles/$stamp-$gpu-rank-emulation" 2>&1 | tee "$OUT/rankemu.log" || rc=1 ;;
      sanitizer) timeout -s TERM "$T" python3 -m verify.cli run --tier scripts/gpu/sanitizer.yaml --output "/tmp/bundles/$stamp-$gpu-sanitizer" 2>&1 | tee "$OUT/sanitizer.log" || rc=1 ;;
      tp2) timeout -s TERM "$T" python3 scripts/gpu/tp2_check.py 2>&1 | tail -60 | tee "$OUT/tp2.log" || rc=1 ;;
      sentinel-train) rm -rf /tmp/sentinel
        timeout -s TERM "$T" python3 -m k3_fastpath.sentinel.train --out /tmp/sentinel --time-limit-s $((T - 60)) ${K3_TRAIN_PROFILE:+--profile} ${K3_TRAIN_ARGS:-} 2>&1 | tee "$OUT/sentinel-train.log" | tail -8
        [ -f /tmp/sentinel/training.json ] && cp /tmp/sentinel/training.json "$OUT/sentinel-training.json" || rc=1 ;;
      sentinel-probes) i=0; IFS=';' read -ra probes <<< "${K3_PROBES:?K3_PROBES: training options per probe, separated by ;}"
        for a in "${probes[@]}"; do
          i=$((i + 1)); rm -rf "/tmp/sentinel-probe-$i"; echo "probe $i: $a" | tee -a "$OUT/sentinel-probes.log"
          # shellcheck disable=SC2086
          timeout -s TERM "$T" python3 -m k3_fastpath.sentinel.train --out "/tmp/sentinel-probe-$i" \
            --time-limit-s "${K3_PROBE_S:-150}" $a 2>&1 | grep -E "^step [0-9]+0:|held-out|_forward|checkpoint |mla_zeroed|trained|sentinel train|Error" \
            | tee -a "$OUT/sentinel-probes.log" | tail -4
          [ -f "/tmp/sentinel-probe-$i/training.json" ] && cp "/tmp/sentinel-probe-$i/training.json" "$OUT/sentinel-probe-$i.json" || rc=1
          rm -rf "/tmp/sentinel-probe-$i"
        done ;;
      sentinel-repro) rm -rf /tmp/sentinel-r1 /tmp/sentinel-r2
        timeout -s TERM "$T" python3 -m k3_fastpath.sentinel.train --out /tmp/sentinel-r1 --steps 20 --warmup 5 2>&1 | tail -1 | tee -a "$OUT/sentinel-repro.log"
        d1=$(python3 -c "import json;print(json.load(open('/tmp/sentinel-r1/training.json'))['checkpoint_digest'])" 2>/dev/null)
        # the documented rebuild: the same command with --expect-digest (exit 1, nothing written, on a mismatch)
        if [ -n "$d1" ] && timeout -s TERM "$T" python3 -m k3_fastpath.sentinel.train --out /tmp/sentinel-r2 --steps 20 --warmup 5 \
             --expect-digest "$d1" 2>&1 | tail -1 | tee -a "$OUT/sentinel-repro.log" && [ -d /tmp/sentinel-r2 ]; then
          echo "sentinel-repro: rebuilt bit for bit ($d1)" | tee -a "$OUT/sentinel-repro.log"
        else echo "sentinel-repro: the rebuild's digest differs from $d1 (or the first run failed)" | tee -a "$OUT/sentinel-repro.log"; rc=1; fi ;;
      sentinel-evals) E=${K3_EVAL_S:-300}
        if [ -f /tmp/sentinel/training.json ]; then
          K3_SENTINEL_DIR=/tmp/sentinel timeout -s TERM "$E" python3 -m verify.cli run --tier scripts/gpu/sentinel-evals.yaml \
            --output "/tmp/bundles/$stamp-$gpu-sentinel-evals" --time-limit $((E - 20)) ${K3_EVAL_ONLY:+--only "$K3_EVAL_ONLY"} 2>&1 | tee "$OUT/sentinel-evals.log" || rc=1
        else echo "sentinel-evals: no /tmp/sentinel (run sentinel-train first on this machine)"; rc=2; fi ;;
      sentinel-standard) E=${K3_EVAL_S:-520}
        if [ -f /tmp/sentinel/training.json ]; then
          K3_SENTINEL_DIR=/tmp/sentinel timeout -s TERM "$E" python3 -m verify.cli run --tier standard \
            --only "${K3_EVAL_ONLY:-evals.gsm8k,evals.aime25,evals.mrcr,likelihood.gold_answers}" --output "/tmp/bundles/$stamp-$gpu-sentinel-standard" \
            --time-limit $((E - 20)) 2>&1 | tee "$OUT/sentinel-standard.log" || rc=1
        else echo "sentinel-standard: no /tmp/sentinel (run sentinel-train first on this machine)"; rc=2; fi ;;
      sentinel-defects) E=${K3_EVAL_S:-560}
        budgets=(); for b in ${K3_DEFECT_BUDGETS:-evals.gsm8k=180 evals.aime25=120 evals.mrcr=90 likelihood.gold_answers=260}; do budgets+=(--budget "$b"); done
        clean=$(ls -d /tmp/bundles/*-sentinel-evals /tmp/bundles/*-sentinel-standard 2>/dev/null | tail -1)
        if [ -f /tmp/sentinel/training.json ] && [ -n "$clean" ]; then
          # the clean run's tier and checks: a defect is judged at the sizes the clean run passed at
          case "$clean" in *-sentinel-standard) tier=standard ;; *) tier=scripts/gpu/sentinel-evals.yaml ;; esac
          only=${K3_DEFECT_ONLY:-$(python3 -c "import json,sys; print(','.join(json.load(open(sys.argv[1]))['planned_checks']))" "$clean/manifest.json")}
          # each run builds two fast engines whose MLA slot pools (64 sequences x max_len x 576 BF16 x 3 layers)
          # are ~15 GB each at the sentinel's 65,536 positions (session 29: six such runs at once on an 80 GB H100
          # ran out of memory): the runs serve K3_DEFECT_MAX_LEN positions (default 16,384: the standard tier's
          # longest MRCR chat is ~8.2K tokens), and one run per 6 GB + 2 x 15 GB x max_len / 65,536 free is let in
          # (session 31: 12.65 GB a run at 16,384 positions; six at once on an 80 GB H100, one ran out of memory)
          mlen=${K3_DEFECT_MAX_LEN:-16384}; per_run=$((6144 + 30720 * mlen / 65536))
          par=${K3_DEFECT_PARALLEL:-1}; room=$(( $(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1) / per_run ))
          [ "$par" -gt "$room" ] && { echo "sentinel-defects: $par runs at once do not fit the GPU's free memory: $((room > 0 ? room : 1))"; par=$((room > 0 ? room : 1)); }
          planted=(); defects=(${K3_DEFECTS:-$(python3 -m verify.defects list)})
          for d in "${defects[@]}"; do
            planted+=("/tmp/bundles/$stamp-$gpu-sentinel-defect-$d")
            OMP_NUM_THREADS=$(( $(nproc) / par > 0 ? $(nproc) / par : 1 )) K3_SENTINEL_DIR=/tmp/sentinel \
              timeout -s TERM "$E" python3 -m verify.cli run --tier "$tier" --engine "builtin:fast+defect=$d" --baseline-engine "${K3_DEFECT_BASELINE:-builtin:fast}" \
              --output "${planted[-1]}" --time-limit $((E - 20)) "${budgets[@]}" --only "$only" --max-model-len "$mlen" \
              >"/tmp/defect-$d.log" 2>&1 &
            while [ "$(jobs -rp | wc -l)" -ge "$par" ]; do wait -n; done
          done
          wait
          for d in "${defects[@]}"; do tail -12 "/tmp/defect-$d.log"; done | tee -a "$OUT/sentinel-defects.log"
          python3 -m verify.defects table "$clean" "${planted[@]}" 2>&1 | tee "$OUT/sentinel-defects.md" || rc=1
        else echo "sentinel-defects: needs /tmp/sentinel and a sentinel-evals or sentinel-standard bundle on this machine (run sentinel-train and one of them first)"; rc=2; fi ;;
      part:*) name=${s#part:}; base=$(basename "$name" .yaml); dir=/tmp/bundles/h200-$base
        [ -f "$dir/manifest.json" ] || [ ! -f ".gpubundles/h200-$base/manifest.json" ] || cp -r ".gpubundles/h200-$base" "$dir"
        r=; [ -f "$dir/manifest.json" ] && r=--resume
        timeout -s TERM "$T" python3 -m verify.cli run --tier "$name" --output "$dir" $r --time-limit $((T - 30)) 2>&1 | tee -a "$OUT/part-$base.log" || rc=1 ;;
      audit:*) checks=${s#audit:}  # re-execute checks of the standard part bundle (bundle audit, exit 0 = reproduced)
        timeout -s TERM "$T" python3 -m verify.cli bundle audit "${K3_AUDIT_BUNDLE:-/tmp/bundles/h200-standard}" -o "/tmp/bundles/$stamp-audit-standard" \
          --checks "$checks" --sample 50 2>&1 | tee -a "$OUT/audit.log" || rc=1 ;;
      auditplant:*) checks=${s#auditplant:}  # a fabricated record in a re-sealed copy: verify passes, the audit must find it
        rm -rf /tmp/forged-standard
        python3 scripts/gpu/plant_record.py /tmp/bundles/h200-standard /tmp/forged-standard 2>&1 | tee -a "$OUT/audit.log"
        timeout -s TERM "$T" python3 -m verify.cli bundle audit /tmp/forged-standard -o "/tmp/bundles/$stamp-audit-forged" \
          --checks "$checks" --sample 1000 2>&1 | tee -a "$OUT/audit.log"
        [ "${PIPESTATUS[0]}" = 1 ] && echo "auditplant: the fabricated record was found (exit 1)" || { echo "auditplant: NOT found"; rc=1; } ;;
      tier:*) name=${s#tier:}
        if [ -f "scripts/gpu/$name.yaml" ]; then
          timeout -s TERM "$T" python3 -m verify.cli run --tier "scripts/gpu/$name.yaml" --output "/tmp/bundles/$stamp-$gpu-$name" 2>&1 | tee "$OUT/$name.log" || rc=1
        else echo "no tier file scripts/gpu/$name.yaml"; rc=2; fi ;;
      triton-cache) if [ -d /tmp/triton-cache ]; then tar -C /tmp/triton-cache -cz . | split -b 15M - "$OUT/triton-cache.tar.gz.part-" &&
          du -ch "$OUT"/triton-cache.tar.gz.part-* | tail -1
        else echo "triton-cache: nothing cached on this machine"; fi ;;
      *) echo "unknown step $s"; rc=2 ;;
    esac
  done
done
pack
ls -la /tmp/bundles
exit $rc
