#!/bin/sh
# longest-functions.sh [N] [PATH...]: the N (default 15) longest C function definitions in the
# git-tracked *.c files under PATH (default: the whole repository of the current directory, else
# the one holding this script), longest first, as "LINES FILE:FIRST-LAST NAME".
#
# A definition starts on a line at column 0 that begins with an identifier and has a '(' (the
# name is the identifier before the first '('), and ends at the next line that is exactly '}'.
# That is the layout of every file in this repository (K&R braces, bodies indented); struct,
# enum and array definitions end with '};' or '} name;' and are not counted.
set -eu
n=15
case "${1:-}" in [0-9]*) n=$1; shift ;; esac
cd "$(git rev-parse --show-toplevel 2>/dev/null || git -C "$(dirname "$0")" rev-parse --show-toplevel)"
git ls-files -z -- "${@:-.}" | tr '\0' '\n' | grep '\.c$' | while IFS= read -r f; do
  awk -v file="$f" '
    /^[A-Za-z_]/ && /\(/ && !/;[ \t]*$/ && !/^(typedef|struct [A-Za-z_]+ *\{|enum|union)/ {
      line = $0; sub(/\(.*/, "", line); k = split(line, w, /[ \t*]+/)
      name = w[k]; start = FNR; next
    }
    /^}[ \t]*$/ && start { print FNR - start + 1, file ":" start "-" FNR, name; start = 0 }
  ' "$f"
done | sort -k1,1nr -k2,2 | head -n "$n"
