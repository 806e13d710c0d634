# Sourced by the device scripts from session 27 on (earlier scripts carry their own copy): the carried
# wheels (.whl, and .bnb's bitsandbytes where carried) installed under /tmp/site, the output folders
# W=$OUT/w (returned files: at most 8, two folders deep) and J=$OUT/w/j/k (the rest), and
# `step NAME LIMIT LOG CMD...`: CMD under a time limit cut so that the script ends by $TOTAL seconds
# (default 575), its status line appended to $W/status.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 FUSEDQKV_SOL_EXECBENCH=$PWD/.shared
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
if [ -d .bnb ]; then cp -r .bnb/bitsandbytes* /tmp/site/; fi
export PYTHONPATH=src:/tmp/site
W=$OUT/w; J=$OUT/w/j/k; mkdir -p $W $J
T0=$(date +%s)
step() {
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$(date +%s)
  local total=${TOTAL:-575}
  if [ $(( t0 - T0 + limit )) -gt $total ]; then limit=$(( total - (t0 - T0) )); fi
  if [ "$limit" -lt 20 ]; then echo "$name skipped (time)" >> "$W/status"; return; fi
  timeout "$limit" "$@" > "$W/$log" 2>&1
  local rc=$?
  echo "$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(grep -E 'passed|failed|PASS|FAIL' "$W/$log" | tail -1 | cut -c1-110)")" >> "$W/status"
}
nvidia-smi --query-gpu=name --format=csv,noheader > $W/gpu.txt
