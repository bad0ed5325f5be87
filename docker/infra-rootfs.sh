#!/bin/sh
# Used by docker/Dockerfile.infra's build stage: gathers into $1 (an empty directory) the root
# filesystem of the infrastructure image, which starts FROM scratch: the venv at /opt/venv, the
# interpreter it points to with its standard library (less what a node never loads: tests, IDLE,
# tkinter, 2to3, ensurepip, the headers and static library), the shared libraries that the
# interpreter and every extension module link (as `ldd` finds them, with the loader's cache), a
# passwd/group holding the unprivileged `swarm` user ($2, its numeric id), /tmp and /data. No shell,
# no package manager, no pip. Then, inside that tree (chroot), it imports what a node imports:
# that proves the tree is complete, and leaves the bytecode of exactly those modules.
set -eu
R=$1
UID_=$2
mkdir -p "$R"
# merged-/usr systems link /lib, /lib64, /bin, /sbin into /usr: keep the links, so no library is copied twice
for d in /lib /lib64 /lib32 /libx32 /bin /sbin; do
  if [ -L "$d" ]; then cp -a "$d" "$R$d" && target=$(readlink "$d") && mkdir -p "$R/${target#/}"; fi
done
copy() {  # the file at path $1 (its target, when a link) at the same path in the tree
  mkdir -p "$R$(dirname "$1")"
  [ -e "$R$1" ] || cp -L "$1" "$R$1"
}
chain() {  # the path $1, every link it passes through as that link, and the file it ends at
  p=$1
  while [ -L "$p" ]; do
    mkdir -p "$R$(dirname "$p")"
    [ -e "$R$p" ] || [ -L "$R$p" ] || cp -P "$p" "$R$p"
    t=$(readlink "$p")
    case $t in /*) p=$t ;; *) p=$(dirname "$p")/$t ;; esac
  done
  copy "$p"
}
python=$(readlink -f /opt/venv/bin/python)
stdlib=$(/opt/venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
dynload=$(/opt/venv/bin/python -c "import sysconfig; print(sysconfig.get_config_var('DESTSHARED'))")
for link in /opt/venv/bin/python*; do chain "$link"; done
mkdir -p "$R$stdlib"
tar -C "$stdlib" -c \
    --exclude=./test --exclude=./idlelib --exclude=./tkinter --exclude=./turtledemo --exclude=./turtle.py \
    --exclude=./lib2to3 --exclude=./ensurepip --exclude=./pydoc_data --exclude='./config-*' \
    --exclude=./site-packages --exclude=./dist-packages --exclude='*/__pycache__' --exclude='*/tests' \
    --exclude='*/idle_test' --exclude='_tkinter*' --exclude='_test*' --exclude='xx*' --exclude='_ctypes_test*' \
    --exclude='_curses*' --exclude='readline*' --exclude='_dbm*' --exclude='_gdbm*' --exclude='*.a' . \
  | tar -C "$R$stdlib" -x
if [ -d "$dynload" ] && [ ! -d "$R$dynload" ]; then  # outside the standard library's folder (some builds)
  mkdir -p "$R$dynload" && cp -a "$dynload"/. "$R$dynload"/
fi
tar -C / -c --exclude='*/__pycache__' opt/venv | tar -C "$R" -x
# every ELF file in the tree, and the libraries each links (ldd: "name => /path (addr)" and the loader)
find "$R" -type f \( -name '*.so' -o -name '*.so.*' -o -path "$R$python" \) | while read -r elf; do
  ldd "$elf" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'
done | sort -u | while read -r lib; do copy "$lib"; done
[ -f /etc/ld.so.cache ] && copy /etc/ld.so.cache
mkdir -p "$R/etc" "$R/tmp" "$R/data"
chmod 1777 "$R/tmp"
printf 'root:x:0:0:root:/root:/nonexistent\nswarm:x:%s:%s::/data:/nonexistent\n' "$UID_" "$UID_" > "$R/etc/passwd"
printf 'root:x:0:\nswarm:x:%s:\n' "$UID_" > "$R/etc/group"
printf 'hosts: files dns\n' > "$R/etc/nsswitch.conf"
chown "$UID_:$UID_" "$R/data"
chroot "$R" /opt/venv/bin/python -c "
import sys
import swarm.cli.peer, swarm.cli.status, swarm.net.nat, swarm.peer
assert 'torch' not in sys.modules and 'numpy' not in sys.modules
"
