# Sourced by run_suite.sh and run_moe_comparison.sh (not run): the bundle's afdep and peer
# scripts, the output folder and the work folder.
#
#   bundle_setup PREFIX
#
# needs $bundle (an absolute path), $out and $work (empty: a new folder under ${TMPDIR:-/tmp}
# named PREFIX.XXXXXX); sets $afdep and $peerdir, makes $out absolute, creates $work, and sets
# $made_work to 1 where it made the work folder itself. Exits 2 on a bundle without bin/afdep or
# peers/moe_torch.py, or on a folder it cannot make.
bundle_setup() {
  afdep="$bundle/bin/afdep"
  peerdir="$bundle/peers"
  [ -x "$afdep" ] || { echo "$afdep is missing: build the bundle with cargo xtask gpu-test --bundle" >&2; exit 2; }
  [ -f "$peerdir/moe_torch.py" ] || { echo "$peerdir/moe_torch.py is missing from the bundle" >&2; exit 2; }
  mkdir -p "$out" || exit 2
  out=$(cd "$out" && pwd)
  made_work=0
  if [ -z "$work" ]; then work=$(mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX") || exit 2; made_work=1; fi
  mkdir -p "$work" || exit 2
}
