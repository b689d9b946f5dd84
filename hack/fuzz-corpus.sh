#!/usr/bin/env bash
# fuzz-corpus.sh - the fuzz targets' corpora as the tree keeps them: named inputs (the seeds
# fuzz/make-seeds.py writes, and the reproducer of every bug fuzzing found, named for it) as files
# under fuzz/corpus/TARGET/, and the inputs the fuzzer grew (named by their SHA-1, thousands of
# them) as one archive per target, fuzz/grown/TARGET.tar.xz, so that they do not swamp the tree.
#
# Usage: hack/fuzz-corpus.sh unpack TARGET DIR   every input of TARGET (named and grown) into DIR
#        hack/fuzz-corpus.sh pack TARGET DIR     DIR's SHA-1-named inputs become TARGET's grown
#                                                archive (after a merge: `-set_cover_merge=1`);
#                                                named inputs in DIR are left for you to commit
# hack/fuzz-smoke.sh and hack/fuzz-coverage.sh unpack what they replay with it. The archive is
# reproducible: sorted names, no owners, times or modes beyond 0644.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# = 3 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
op=$1 target=$2 dir=$3
archive=$root/fuzz/grown/$target.tar.xz
[ -d "$root/fuzz/corpus/$target" ] || { echo "fuzz-corpus: no target $target" >&2; exit 2; }
case $op in
    unpack)
        mkdir -p "$dir"
        cp "$root/fuzz/corpus/$target"/* "$dir"/
        [ ! -e "$archive" ] || tar -xJf "$archive" -C "$dir"
        ;;
    pack)
        mkdir -p "$root/fuzz/grown"
        list=$(mktemp)
        trap 'rm -f "$list"' EXIT
        (cd "$dir" && find . -maxdepth 1 -type f -printf '%f\n' | grep -E '^[0-9a-f]{40}$' | LC_ALL=C sort) > "$list"
        tar -cJf "$archive.part" -C "$dir" --owner=0 --group=0 --numeric-owner --mode=0644 \
            --mtime=@0 --no-recursion -T "$list"
        mv "$archive.part" "$archive"
        echo "fuzz-corpus: $(wc -l < "$list") grown inputs of $target in ${archive#"$root"/}"
        ;;
    *) echo "fuzz-corpus: unknown operation $op" >&2; exit 2;;
esac
