#!/usr/bin/env bash
# Rebuilds offline.html, the page template `dvc plots show` fills (.dvc/config: plots.html_template), with
# vega, vega-lite and vega-embed inline from their npm packages: DVC's own page loads them from a CDN, a blank
# page offline. The versions follow DVC's renderer (dvc-render's specs are vega-lite v5: vega 5, vega-lite 5,
# vega-embed 6). The template has no {scripts} placeholder, so DVC adds none of its CDN <script> tags.
# Needs npm and the registry; run from anywhere: bash configs/plots/vendor.sh
set -euo pipefail
VEGA=5.33.1 VEGA_LITE=5.23.0 VEGA_EMBED=6.29.0
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm pack --silent "vega@$VEGA" "vega-lite@$VEGA_LITE" "vega-embed@$VEGA_EMBED" >/dev/null
# vega-embed's build bundles these (its other bundled packages are vega's own, BSD-3-Clause, and tslib, 0BSD):
# their notices go in LICENSE.vega
BUNDLED=(fast-json-patch@3 json-stringify-pretty-compact@4 semver@7)
npm pack --silent "${BUNDLED[@]}" >/dev/null
for tarball in *.tgz; do mkdir "${tarball%.tgz}" && tar xzf "$tarball" -C "${tarball%.tgz}"; done
inline() {  # <script> with a file's text; refuses one that would end the element early or hold a placeholder
  if grep -qiE '</script|<!--|\{(scripts|plot_divs|refresh_tag)\}' "$1"; then echo "cannot inline $1" >&2; exit 1; fi
  printf '<script>\n'; grep -v '^//# sourceMappingURL=' "$1"; printf '</script>\n'  # no source map to fetch
}
{
  cat <<HEAD
<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
{refresh_tag}
<title>fineflow: DVC plots</title>
<!-- vega $VEGA, vega-lite $VEGA_LITE, vega-embed $VEGA_EMBED from npm, inline (BSD-3-Clause; bundled MIT/ISC parts: configs/plots/LICENSE.vega);
     rebuilt by configs/plots/vendor.sh. Nothing on this page is loaded from the network. -->
HEAD
  inline "vega-$VEGA/package/build/vega.min.js"
  inline "vega-lite-$VEGA_LITE/package/build/vega-lite.min.js"
  inline "vega-embed-$VEGA_EMBED/package/build/vega-embed.min.js"
  cat <<'TAIL'
<style>
  table { border-spacing: 15px; }
</style>
</head>
<body>
{plot_divs}
</body>
</html>
TAIL
} >"$here/offline.html"
{
  echo "vega $VEGA, vega-lite $VEGA_LITE, vega-embed $VEGA_EMBED (with vega-themes, vega-tooltip, vega-interpreter,"
  echo "vega-schema-url-parser bundled: the same holder and licence):"
  echo
  cat "vega-lite-$VEGA_LITE/package/LICENSE"
  for tarball in fast-json-patch-*.tgz json-stringify-pretty-compact-*.tgz semver-*.tgz; do
    printf '\n---- %s, bundled in vega-embed.min.js ----\n\n' "${tarball%.tgz}"
    cat "${tarball%.tgz}"/package/LICENSE*
  done
} >"$here/LICENSE.vega"
echo "wrote $here/offline.html ($(wc -c <"$here/offline.html") bytes)"
