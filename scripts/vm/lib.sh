# Shared by the scripts in scripts/vm/ (sourced, not run). Paths, messages and the helpers that
# copy host files into a guest root. Holds no policy of its own: each script decides what to do.
# shellcheck shell=bash
# The settings below are read by the scripts that source this file.
# shellcheck disable=SC2034

VM_SCRIPTS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VM_REPO="$(cd "$VM_SCRIPTS/../.." && pwd)"
# Cache and build output; never committed (.gitignore has /.vm). ERDMA_VM_DIR moves it (CI caches).
VM_DIR="${ERDMA_VM_DIR:-$VM_REPO/.vm}"
VM_KERNELS="$VM_DIR/kernel"
VM_IMAGE="$VM_DIR/image"

# Tap link between the host and the guest (scripts/vm/run --tap).
VM_TAP_DEV="${ERDMA_VM_TAP:-tap0}"
VM_TAP_HOST_IP="10.77.0.1"
VM_TAP_GUEST_IP="10.77.0.2"
VM_TAP_PREFIX=24
VM_TAP_GUEST_MAC="52:54:00:4d:00:02"
# The guest's soft-iWARP device siw0 and the dummy netdev (and subnet) it sits on.
VM_SIW_NETDEV="iw0"
VM_SIW_IP="10.0.3.15"
# Address of the guest under QEMU's user-mode network (everything stays inside the guest).
VM_USER_GUEST_IP="10.0.2.15"
VM_USER_GATEWAY="10.0.2.2"

vm_prog="scripts/vm/$(basename "$0")"

vm_say() { printf '%s: %s\n' "$vm_prog" "$*" >&2; }
# Under set -e a failing command would end a script silently; name it instead.
# shellcheck disable=SC2154 # vm_status is set inside the trap itself
trap 'vm_status=$?; vm_say "line $LINENO: \"$BASH_COMMAND\" failed (status $vm_status)"' ERR
vm_die() {
  printf '%s: error: %s\n' "$vm_prog" "$*" >&2
  exit 1
}

# Seconds since the epoch with microseconds (bash 5).
vm_now() { printf '%s' "${EPOCHREALTIME/,/.}"; }
# Seconds elapsed since $1 (a vm_now value), one decimal.
vm_since() { awk -v a="$1" -v b="$(vm_now)" 'BEGIN { printf "%.1f", b - a }'; }

# The kernel release the harness boots: the one `setup` unpacked last.
vm_kernel_release() {
  local link="$VM_KERNELS/current"
  [[ -L $link ]] || return 1
  basename "$(readlink "$link")"
}

# Copies one host file into the guest root $VM_STAGE at the same (canonical) path, recreating
# symbolic links along the way so that `libfoo.so.1 -> libfoo.so.1.2.3` stays a link. Directories
# are canonicalised first, so a host with /lib -> usr/lib lands in the guest's usr/lib.
vm_stage_copy() {
  local src=$1 dir base dst target
  dir="$(realpath -e "$(dirname "$src")")" || return 1
  base="${src##*/}"
  # shellcheck disable=SC2153 # VM_STAGE is set by the caller.
  dst="$VM_STAGE$dir/$base"
  [[ -e $dst || -L $dst ]] && return 0
  mkdir -p "$VM_STAGE$dir"
  if [[ -L $dir/$base ]]; then
    target="$(readlink "$dir/$base")"
    ln -s "$target" "$dst"
    case $target in
      /*) vm_stage_copy "$target" ;;
      *) vm_stage_copy "$dir/$target" ;;
    esac
  else
    cp --preserve=mode "$dir/$base" "$dst"
  fi
}

# Prints, one per line, the shared libraries (and the dynamic loader) that the given ELF files
# need, as absolute host paths. Fails naming the library when one cannot be found.
vm_elf_deps() {
  [[ $# -gt 0 ]] || return 0
  local out
  # ldd exits non-zero when one of the files is static; the output still lists the others.
  out="$(LC_ALL=C ldd "$@" 2>/dev/null || true)"
  if grep -q 'not found' <<<"$out"; then
    grep 'not found' <<<"$out" | sed 's/^[[:space:]]*/missing library: /' >&2
    return 1
  fi
  awk '$2 == "=>" && $3 ~ /^\// { print $3; next } $1 ~ /^\// && NF == 2 { print $1 }' <<<"$out" |
    LC_ALL=C sort -u
}

# Writes a newc cpio of the directory $1 (owned by root) to stdout.
vm_cpio_of() {
  (cd "$1" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet)
}
