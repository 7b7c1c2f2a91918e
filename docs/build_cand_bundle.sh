#!/usr/bin/env bash
# Builds bundle/ for docs/gpu_cand_call.sh (candidate branches against main and 52a7948 on one
# GPU) on a machine with Rust and no GPU. The bundle/ folder is not kept between sessions (it
# is ignored by git, and a new session's checkout starts without it): this script rebuilds it
# from commits in about 25 minutes on 2 cores.
#
#   bash docs/build_cand_bundle.sh              # from the repository root
#
# Environment:
#   CANDS   "NAME=SPEC ..." (default: the diffs of docs/candidates/, as plan and dh): a stripped release `afdep` of each as bundle/afdep-NAME.gz. SPEC is a commit,
#           or `diff:FILE`: this checkout's HEAD with FILE applied (`git diff main...BRANCH` of
#           a branch that did not land; docs/candidates/ keeps them, since branches do not
#           survive into a new session's checkout either)
#   TESTS   "NAME=SPEC:BIN,BIN ..." (default "plan=diff:docs/candidates/plan-lean.diff:gpu_nvlink_graph,gpu_nvlink_count_first,gpu_nvlink_engines,gpu_nvlink_faults,gpu_nvlink_fp8,gpu_nvlink_rejects,gpu_nvlink_auto_arm,gpu_nvlink_on_stream,gpu_pipeline"):
#           afdep-moe test binaries of REV as bundle/NAME-tests.txz (folder NAME-tests/)
#   OLD     the baseline commit of issue 20 (default 52a7948), as bundle/afdep-52.gz ("" leaves
#           it out)
#   MAIN    0 leaves main's GPU-test bundle out (default 1)
#   WT      where the worktrees go (default /tmp/afdep-cand-wt)
#
# Each build gets its own copy of main's target folder with the workspace's crates cleaned:
# worktrees that share one target folder can link another worktree's sources (cargo takes the
# build as fresh; see afdep_kernels::sources::EMBEDDED_FROM), and every binary's debug info is
# checked for its own worktree's folder before it is stripped and packed.
set -euo pipefail
ROOT=$(pwd)
[ -f "$ROOT/Cargo.toml" ] && [ -d "$ROOT/crates/afdep-kernels" ] || { echo "run from the repository root" >&2; exit 2; }
D=docs/candidates
CANDS=${CANDS:-"plan=diff:$D/plan-lean.diff dh=diff:$D/dh-prefetch.diff"}
TESTS=${TESTS:-"plan=diff:$D/plan-lean.diff:gpu_nvlink_graph,gpu_nvlink_count_first,gpu_nvlink_engines,gpu_nvlink_faults,gpu_nvlink_fp8,gpu_nvlink_rejects,gpu_nvlink_auto_arm,gpu_nvlink_on_stream,gpu_pipeline"}
OLD=${OLD-52a7948}
WT=${WT:-/tmp/afdep-cand-wt}
MEMBERS="-p afdep-core -p afdep-kernels -p afdep-moe -p afdep-transport -p afdep-bench"
FEAT_T=afdep-moe/nccl,afdep-moe/ucx,afdep-moe/cuda,afdep-moe/fault-injection
mkdir -p bundle "$WT"

if [ "${MAIN:-1}" != 0 ]; then
  echo "== main's GPU-test bundle (bundle/bundle.txz, folder b4)"
  rm -rf "$WT/b4"
  cargo xtask gpu-test --bundle "$WT/b4"
  tar cf - -C "$WT" b4 | xz -6 -T2 > bundle/bundle.txz
fi

# prepare NAME SPEC: a worktree of SPEC (a commit, or diff:FILE on HEAD) and a copy of main's
# target folder, cleaned
prepare() {
  local name=$1 spec=$2
  git worktree remove --force "$WT/src-$name" 2>/dev/null || true
  rm -rf "$WT/src-$name" "$WT/tgt-$name"
  case $spec in
    diff:*)
      git worktree add -q --detach "$WT/src-$name" HEAD
      git -C "$WT/src-$name" apply --index "$ROOT/${spec#diff:}"
      git -C "$WT/src-$name" -c user.name=cand -c user.email=cand@localhost commit -q -m "candidate $name: ${spec#diff:}";;
    *) git worktree add -q --detach "$WT/src-$name" "$spec";;
  esac
  cp -a "$ROOT/target" "$WT/tgt-$name"
  (cd "$WT/src-$name" && CARGO_TARGET_DIR="$WT/tgt-$name" cargo clean -q $MEMBERS --release)
}
# the binary must come from its own worktree (its debug info names the folder it was built in;
# checked before strip)
check_own() {
  # (no grep -q: with pipefail, strings killed by SIGPIPE would fail the check)
  strings "$1" | grep -F "$2" > /dev/null || { echo "$1 was not built from $2" >&2; exit 1; }
}

for spec in $CANDS ${OLD:+"52=$OLD"}; do
  name=${spec%%=*}; rev=${spec#*=}
  echo "== afdep of $rev as bundle/afdep-$name.gz"
  prepare "$name" "$rev"
  (cd "$WT/src-$name" && CARGO_TARGET_DIR="$WT/tgt-$name" cargo build -q --release -p afdep-bench --features nccl,ucx --bin afdep)
  bin="$WT/tgt-$name/release/afdep"
  [ "$name" = 52 ] || check_own "$bin" "$WT/src-$name"
  strip -o "$WT/afdep-$name" "$bin"
  gzip -c "$WT/afdep-$name" > "bundle/afdep-$name.gz"
done

for spec in $TESTS; do
  name=${spec%%=*}; rest=${spec#*=}; rev=${rest%:*}; bins=${rest##*:}
  echo "== $bins of $rev as bundle/$name-tests.txz"
  [ -d "$WT/src-$name" ] || prepare "$name" "$rev"
  args=()
  for b in ${bins//,/ }; do args+=(--test "$b"); done
  (cd "$WT/src-$name" && CARGO_TARGET_DIR="$WT/tgt-$name" cargo test -q --release --no-run -p afdep-moe \
    --features "$FEAT_T" "${args[@]}" --message-format=json) > "$WT/$name-tests.json"
  rm -rf "$WT/$name-tests"; mkdir -p "$WT/$name-tests"
  python3 - "$WT/$name-tests.json" "$WT/$name-tests" "$WT/src-$name" <<'PY'
import json, subprocess, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if r.get("reason") == "compiler-artifact" and r.get("executable") and r["target"]["kind"][0] == "test":
        # built from this worktree's sources (before strip drops the debug info naming them)
        if open(r["executable"], "rb").read().find(sys.argv[3].encode()) < 0:
            sys.exit(f"{r['executable']} was not built from {sys.argv[3]}")
        subprocess.run(["strip", "-o", sys.argv[2] + "/" + r["target"]["name"], r["executable"]], check=True)
PY
  tar cJf "bundle/$name-tests.txz" -C "$WT" "$name-tests"
done
cp docs/gpu_cand_call.sh bundle/
du -sh bundle
echo "bundle/ ready: carry [\"bundle\"], run: LIMIT=570 bash bundle/gpu_cand_call.sh"
