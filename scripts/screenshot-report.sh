#!/usr/bin/env bash
# Regenerate docs/img/diff-report.png: the HTML report of `trajtrack demo`'s diff, rendered by
# headless Chromium 1200 px wide, reduced to 256 colours (Pillow, which matplotlib brings).
#   scripts/screenshot-report.sh [OUT.png]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/img/diff-report.png}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && python3 -m trajtrack demo runs >/dev/null)
# The page is ~1,540 px high; the window is the screenshot.
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1200,1540 \
    --screenshot="$work/shot.png" "file://$work/runs/diff-report.html" >/dev/null 2>&1
python3 - "$work/shot.png" "$out" <<'PY'
import sys

from PIL import Image

image = Image.open(sys.argv[1]).convert("RGB")
image.quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(
    sys.argv[2], optimize=True
)
PY
echo "wrote $out"
