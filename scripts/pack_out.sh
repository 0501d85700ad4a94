#!/usr/bin/env bash
# Run last in a device call: where more files lie directly under $OUT than the device tool brings
# back (8), packs every .txt and .log among them into $OUT/logs.tar.gz, so that the JSONs and the
# logs all come back (the archive is the one file in their place). Nothing changes otherwise.
#   bash scripts/pack_out.sh            # at the end of a call script
set -euo pipefail
: "${OUT:?OUT is not set}"
LIMIT=${HJ_OUT_FILES:-8}
cd "$OUT"
shopt -s nullglob
all=(*)
(( ${#all[@]} <= LIMIT )) && exit 0
logs=(*.txt *.log)
(( ${#logs[@]} == 0 )) && { echo "pack_out: ${#all[@]} files under \$OUT and no .txt / .log to pack" >&2; exit 0; }
tar czf logs.tar.gz "${logs[@]}" && rm -f "${logs[@]}"
echo "pack_out: ${#logs[@]} logs packed into logs.tar.gz ($(ls | wc -l) files under \$OUT)"
