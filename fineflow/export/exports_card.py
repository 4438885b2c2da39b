"""The exports' model card (``models/export/README.md``): every file the export stage wrote, with its parity figures
and the command that serves it, the way a GGUF repository's card on the Hugging Face Hub reads.

Written from the stage's report alone (and the champion's record), so the card and export.json never disagree. The
same section goes last into the champion's own card (``champion_card_with_exports``).
"""

from __future__ import annotations

from pathlib import Path

from fineflow.export.formats import FORMATS
from fineflow.registry.card import EXPORTS_HEADING, without_exports


def export_card(report: dict, champion: dict, out_dir: Path) -> str:
    """The card's markdown: front matter, the files with their parity, how to serve each runtime, the checks."""
    front = ["---", f"base_model: {champion.get('base_model') or 'unknown'}", "library_name: gguf"]
    front += ["tags: [gguf, llama.cpp, fineflow]", "---", "", f"# Champion {report['champion']}: exports", ""]
    return "\n".join(front + exports_section(report, champion, out_dir)) + "\n"


def champion_card_with_exports(card: str, report: dict, champion: dict, out_dir: Path) -> str:
    """The champion's own card (models/champion/README.md) with its exports as the last section, replacing the
    one an earlier export wrote (fineflow.registry.card.EXPORTS_HEADING: outside what the promotion log binds)."""
    section = [EXPORTS_HEADING, ""]
    if not report["exports"]:
        section.append(f"Nothing exported: {report.get('skipped')}.")
    else:
        section += [f"Files in `{out_dir}` (its README.md is their card).", ""]
        section += exports_section(report, champion, out_dir)
    return without_exports(card).rstrip("\n") + "\n\n" + "\n".join(section).replace("\n## ", "\n### ") + "\n"


def exports_section(report: dict, champion: dict, out_dir: Path) -> list[str]:
    """The exports, their parity and how to serve them: the body of both cards."""
    exports = report["exports"]
    return [
        f"The champion installed by promotion log entry {champion.get('promotion_seq')}, exported by llama.cpp "
        f"(llama-cpp-python {report['tools']['llama_cpp_python']}, converter sha256 "
        f"{str(report['tools']['converter_sha256'])[:12]}) from {report['source']}, and checked against the model the "
        f"gate evaluated on {report['eval_docs']} eval docs: the same token ids, the same chat template rendering, "
        "the same stop tokens, and exact match within the type's tolerance (paired bootstrap; a type without one "
        "is reported, not gated).",
        "",
        "| file | type | size | shippable | exact match (llama.cpp) | transformers | difference (CI) | same answer "
        "| tolerance |",
        "|---|---|---|---|---|---|---|---|---|",
        *(_export_row(export) for export in exports.values()),
        "",
        *_refusals(exports),
        *_serving(report, out_dir),
        *_check_figures(exports),
    ]


def _export_row(export: dict) -> str:
    scores = export["checks"]["scores"]["figures"]
    ci = scores["ci"]
    tolerance = f"±{scores['tolerance']}" if scores.get("gated") else "reported, not gated"
    return (
        f"| {export['file']} | {export['type']} | {export['bytes'] / 1e6:,.1f} MB | "
        f"{'yes' if export['shippable'] else '**no**'} | {scores['exact_match']:.3f} | "
        f"{scores['reference_exact_match']:.3f} | {scores['delta']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}] | "
        f"{scores['same_answer']:.3f} | {tolerance} |"
    )


def _refusals(exports: dict) -> list[str]:
    """Each file that is not shippable, with every reason (the first thing a reader must see)."""
    lines = []
    for export in exports.values():
        if not export["shippable"]:
            lines += [f"**{export['file']} is not shippable:**", *(f"- {reason}" for reason in export["reasons"]), ""]
    return lines


def _serving(report: dict, out_dir: Path) -> list[str]:
    """The commands that serve the exports: each format's (fineflow.export.formats), in the registry's order."""
    return [
        "## Serve it",
        "",
        *(line for export_format in FORMATS.values() for line in export_format.serving(report, out_dir)),
    ]


def _check_figures(exports: dict) -> list[str]:
    """The three checks that need no weights, per file."""
    lines = [
        "## Parity checks",
        "",
        "| file | token ids equal | chat template renderings equal | EOS (training, file) |",
        "|---|---|---|---|",
    ]
    for export in exports.values():
        checks = export["checks"]
        tokens, template, stop = (checks[name]["figures"] for name in ("token_ids", "chat_template", "stop_tokens"))
        conversations = template.get("conversations", 0)
        lines.append(
            f"| {export['file']} | {tokens.get('equal')}/{tokens.get('texts')} | "
            f"{template.get('equal', 0)}/{2 * conversations} | {stop.get('training_eos')}, {stop.get('gguf_eos')} |"
        )
    return lines
