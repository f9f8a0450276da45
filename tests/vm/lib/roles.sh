# Sourced by the guest scripts (tests/vm/*.sh): runs the ignored roles of a test binary in the
# payload directory.
# shellcheck shell=sh

# role BINARY NAME [VAR=VALUE...]: runs one role with the variables set, and insists that it ran
# and passed (prints "ok   NAME", or "FAIL NAME" and its output). The output stays in
# /tmp/BINARY-NAME.log.
role() {
  bin=$1 name=$2
  shift 2
  out=/tmp/$bin-$name.log
  if env "$@" timeout 120 "./$bin" --ignored --exact "$name" --nocapture >"$out" 2>&1 &&
    grep -q "test result: ok. 1 passed" "$out"; then
    echo "ok   $name"
    return 0
  fi
  echo "FAIL $name"
  cat "$out"
  return 1
}
